"""Client-side timings of one streamed OpenAI completion (server-sent events), chat
(`choices[].delta.content`) or plain (`choices[].text`): each chunk that carries text is a
token's arrival (TTFT at the first, an inter-token gap at each next), the usage in the last
chunk gives the exact counts (a chunk may carry several tokens, or none where a token is part of
a character). Pure: the caller reads the lines and says when each arrived.
"""

from __future__ import annotations

import json

from disagg.bench.metrics import RequestRecord, TokenTimer


class StreamTimer:
    """Feed every line of the response body with its arrival time, then `finish`. `started`:
    when the request was sent; `clock_zero`: what `RequestRecord.token_times` count from."""

    def __init__(self, started: float, clock_zero: float = 0.0):
        self.timer = TokenTimer(started)
        self.clock_zero = clock_zero
        self.done = False  # `data: [DONE]` came
        self.finish_reason = ""
        self.usage: dict = {}
        self.error: dict = {}  # an error event mid-stream ({"message", "code", ...})
        self.text: list[str] = []
        self.token_times: list[float] = []

    def on_line(self, line: str | bytes, now: float) -> None:
        text = (line.decode() if isinstance(line, bytes) else line).strip()
        if not text.startswith("data:"):
            return  # blank separators, comments, other fields
        data = text[len("data:") :].strip()
        if data == "[DONE]":
            self.done = True
            return
        self._on_event(json.loads(data), now)

    def finish(self, record: RequestRecord, now: float) -> RequestRecord:
        """Fill `record` with the stream's outcome: timings and counts, or its failure."""
        record.finish_reason = self.finish_reason
        record.text = "".join(self.text)
        record.token_times = self.token_times
        if self.error or not self.done or not self.finish_reason:
            record.error_code = str(self.error.get("code", "")).upper() or "UNKNOWN"
            record.error = self.error.get("message", "") or "the stream ended without a finish reason and [DONE]"
            return record
        self.timer.finish(record, now)
        counted = self.usage.get("completion_tokens")
        if counted is not None and counted != record.output_len:
            record.output_len = counted  # TPOT divides by the tokens the server generated
        record.prompt_len = self.usage.get("prompt_tokens", record.prompt_len)
        record.server = dict(self.usage)
        return record

    def _on_event(self, event: dict, now: float) -> None:
        if "error" in event:
            self.error = event["error"] or {"message": "error event"}
            return
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            text = (choice.get("delta") or {}).get("content") or choice.get("text")
            if text:
                self.timer.on_message(1, now)
                self.text.append(text)
                self.token_times.append(now - self.clock_zero)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
