"""What an engine reports per request (vLLM's RequestOutput / CompletionOutput shape)."""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.request import RequestTimings


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort"; None while running (or handed to decode)
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestTimings
    new_token_ids: list[int] = field(default_factory=list)  # this step's tokens (streaming)
    new_text: str = ""
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None  # set when a step failed on this request (it ended with finish_reason "abort")
