"""Plain data exchanged between the router and the workers (crosses Ray, so no live objects)."""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.kv_transfer.layout import KVLayout


@dataclass
class TokenDelta:
    """New tokens of one request since the last delta: what a decode (or colocated) worker streams."""

    request_id: str
    token_ids: list[int]
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # set when the request failed on the worker (e.g. its KV never arrived)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    queue_s: float = 0.0  # worker-side durations, measured on the worker's own clock
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    decode_s: float = 0.0
    prefill_instance: str = ""  # set by the router: where the request ran
    decode_instance: str = ""

    def merge(self, later: "TokenDelta") -> None:
        """Fold a later delta of the same request into this one (the consumer was slow)."""
        self.token_ids += later.token_ids
        self.text += later.text
        self.logprobs += later.logprobs
        for name in ("finished", "finish_reason", "error", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens", "queue_s", "prefill_s", "transfer_s", "transfer_bytes", "decode_s"):
            setattr(self, name, getattr(later, name))


@dataclass
class PrefillResult:
    """The first token of a request, from a prefill worker (this is what sets TTFT)."""

    request_id: str
    token_id: int
    text: str
    logprob: float | None
    finished: bool  # the first token already ends the request (EOS, max_tokens=1, ...)
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_s: float
    prefill_s: float


@dataclass(frozen=True)
class Reservation:
    """A decode instance's answer to the handshake: blocks allocated for the prompt (the same ids
    on every rank), and the transfer each of its ranks expects."""

    transfer_id: int  # rank 0's
    block_ids: list[int]
    transfer_ids: dict[str, int] = field(default_factory=dict)  # KV peer id -> transfer id, every rank
    layout: KVLayout | None = None  # the decode instance's KV endpoints
