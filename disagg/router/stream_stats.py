"""What one request's stream of deltas adds up to: its usage and where its time went, measured
as the frontend sees it, whatever API the request came in by."""

from __future__ import annotations

import time
from dataclasses import dataclass

from disagg.rpc.messages import TokenDelta


@dataclass(frozen=True)
class Outcome:
    """What a finished request reports with its last delta (usage, timings, placement)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    queue_s: float
    prefill_s: float
    transfer_s: float
    transfer_bytes: int
    decode_s: float
    ttft_s: float
    e2e_s: float
    itl: tuple[float, ...]  # seconds between token arrivals, per token
    prefill_instance: str
    decode_instance: str
    predicted_ttft_s: float
    predicted_tpot_s: float

    def record(self, request_id: str) -> dict:
        """The request's entry in the records kept in Redis (disagg.router.records)."""
        return {
            "request_id": request_id,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "queue_s": self.queue_s,
            "prefill_s": self.prefill_s,
            "transfer_s": self.transfer_s,
            "decode_s": self.decode_s,
        }


class StreamStats:
    """Follows the deltas of one request as they reach the frontend."""

    def __init__(self, started: float, num_prompt_tokens: int):
        self.started = started  # time.perf_counter()
        self.num_prompt_tokens = num_prompt_tokens
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.itl: list[float] = []
        self.completion_tokens = 0
        self.prefill_s = self.transfer_s = 0.0
        self.transfer_bytes = 0
        self.cached = 0

    def observe(self, delta: TokenDelta) -> Outcome | None:
        """Account for `delta`; the request's outcome if it is the last one."""
        now = time.perf_counter()
        if delta.token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                self.prefill_s, self.cached = delta.prefill_s, delta.num_cached_tokens
            elif self.last_token_at is not None:
                self.itl.append((now - self.last_token_at) / len(delta.token_ids))
            self.last_token_at = now
        self.completion_tokens += len(delta.token_ids)
        self.transfer_s = delta.transfer_s or self.transfer_s
        self.transfer_bytes = delta.transfer_bytes or self.transfer_bytes
        return self._outcome(delta, now) if delta.finished else None

    def _outcome(self, last: TokenDelta, now: float) -> Outcome:
        first = self.first_token_at or now
        ttft = first - self.started
        return Outcome(
            finish_reason=last.finish_reason or "stop",
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_prompt_tokens=self.cached,
            queue_s=max(0.0, ttft - self.prefill_s),
            prefill_s=self.prefill_s,
            transfer_s=self.transfer_s,
            transfer_bytes=self.transfer_bytes,
            decode_s=now - first,
            ttft_s=ttft,
            e2e_s=now - self.started,
            itl=tuple(self.itl),
            prefill_instance=last.prefill_instance,
            decode_instance=last.decode_instance,
            predicted_ttft_s=last.predicted_ttft_s,
            predicted_tpot_s=last.predicted_tpot_s,
        )
