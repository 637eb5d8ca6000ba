"""Answers of the OpenAI API built from the request path's deltas: whole responses, the chunks
of a streamed one, and errors in OpenAI's shape. Pure: no aiohttp.

Finish reasons pass through: "stop" and "length" are OpenAI's own; "abort" (a request ended by
gRPC's Abort) has no OpenAI counterpart, and vLLM sends it as is too.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg.errors import InvalidRequestError
from disagg.router.openai_requests import ApiRequest
from disagg.router.stream_stats import Outcome
from disagg.rpc.messages import TokenDelta

ERROR_TYPES = {
    "INVALID_ARGUMENT": "invalid_request_error",
    "UNAUTHENTICATED": "authentication_error",
    "NOT_FOUND": "not_found_error",
    "RESOURCE_EXHAUSTED": "rate_limit_error",
    "UNAVAILABLE": "service_unavailable_error",
    "DEADLINE_EXCEEDED": "timeout_error",
}
# gRPC's names of the request's fields (disagg.router.validation) as OpenAI's.
_PARAM_NAMES = {
    "chat": "messages",
    "chat.messages": "messages",
    "prompt_token_ids": "prompt",
    "structured": "response_format",
}


def error_body(code: str, message: str, param: str | None = None) -> dict:
    """`code`: the gRPC status code name the failure maps to (disagg.errors), lower-cased in the
    answer so that logs of both APIs read alike."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(code, "server_error"),
            "param": param,
            "code": code.lower(),
        }
    }


def invalid_request_body(exc: InvalidRequestError) -> dict:
    """A refused input, with the field named as OpenAI's API names it."""
    param = openai_param(exc.field)
    reason = str(exc).removeprefix(f"{exc.field}: ")
    return error_body(exc.grpc_code_name, f"{param}: {reason}", param)


def openai_param(field_name: str) -> str:
    name = field_name.removeprefix("sampling.")
    if name.startswith("chat.messages["):
        return name.removeprefix("chat.")
    return _PARAM_NAMES.get(name, name)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)  # the chosen tokens' text, when logprobs are asked for
    logprobs: list[float] = field(default_factory=list)
    token_chars: int = 0  # characters of those tokens so far (a completion's logprobs give offsets)
    finish_reason: str | None = None
    outcome: Outcome | None = None
    started: bool = False  # a chunk of it was sent (a chat stream names the role in the first)


class Answer:
    """The answer to one ApiRequest, built as its choices' deltas come. `token_text` turns a
    token id into its text (for logprobs)."""

    def __init__(self, api: ApiRequest, model: str, token_text: Callable[[int], str]):
        self.api = api
        self.model = model
        self.token_text = token_text
        self.id = f"{'chatcmpl' if api.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [_Choice() for _ in range(api.n)]

    # ---- streamed ------------------------------------------------------------------------------------
    def chunk(self, index: int, delta: TokenDelta, outcome: Outcome | None) -> dict | None:
        """The chunk that carries `delta` of choice `index` (None: it carries nothing to say)."""
        choice = self.choices[index]
        start = choice.token_chars
        tokens = self._add(choice, delta, outcome)
        if not (delta.text or tokens or outcome):
            return None
        part = {"index": index, "logprobs": self._logprobs(tokens, delta.logprobs, start), "finish_reason": None}
        if outcome is not None:
            part["finish_reason"] = outcome.finish_reason
        if self.api.chat:
            part["delta"] = {"content": delta.text} if delta.text or not choice.started else {}
            if not choice.started:
                part["delta"]["role"] = "assistant"
        else:
            part["text"] = delta.text
        choice.started = True
        return self._envelope([part], chunk=True)

    def usage_chunk(self) -> dict:
        """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
        return {**self._envelope([], chunk=True), "usage": self.usage()}

    # ---- whole ---------------------------------------------------------------------------------------
    def add(self, index: int, delta: TokenDelta, outcome: Outcome | None) -> None:
        self._add(self.choices[index], delta, outcome)

    def whole(self) -> dict:
        parts = []
        for index, choice in enumerate(self.choices):
            text = "".join(choice.text)
            part = {"index": index, "logprobs": self._logprobs(choice.tokens, choice.logprobs)}
            if self.api.chat:
                part["message"] = {"role": "assistant", "content": text}
            else:
                part["text"] = text
            part["finish_reason"] = choice.finish_reason
            parts.append(part)
        return {**self._envelope(parts, chunk=False), "usage": self.usage()}

    def usage(self) -> dict:
        """The prompt counts once, whatever n (the choices share it); completions add up."""
        outcomes = [c.outcome for c in self.choices if c.outcome is not None]
        prompt = outcomes[0].prompt_tokens if outcomes else 0
        completion = sum(o.completion_tokens for o in outcomes)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": outcomes[0].cached_prompt_tokens if outcomes else 0},
        }

    # ---- shared --------------------------------------------------------------------------------------
    def _add(self, choice: _Choice, delta: TokenDelta, outcome: Outcome | None) -> list[str]:
        """Fold the delta into its choice; the text of its tokens when logprobs are asked for."""
        choice.text.append(delta.text)
        tokens = [self.token_text(t) for t in delta.token_ids] if self.api.logprobs else []
        choice.tokens += tokens
        choice.token_chars += sum(len(t) for t in tokens)
        choice.logprobs += delta.logprobs
        if outcome is not None:
            choice.finish_reason, choice.outcome = outcome.finish_reason, outcome
        return tokens

    def _logprobs(self, tokens: list[str], logprobs: list[float], start: int = 0) -> dict | None:
        """`start`: where the first of `tokens` begins in its choice's text."""
        if not self.api.logprobs:
            return None
        if self.api.chat:
            return {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(tokens, logprobs)
                ]
            }
        offsets = list(itertools.accumulate((len(t) for t in tokens), initial=start))[: len(tokens)]
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs)],  # the chosen one only
            "text_offset": offsets,
        }

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.api.chat else "text_completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if chunk and self.api.include_usage:
            body["usage"] = None  # OpenAI's: every chunk says it, the last one carries it
        return body
