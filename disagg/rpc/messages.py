"""Plain data exchanged between the router and the workers over the request link: dataclasses of
primitive fields, encoded with a fixed schema (disagg.rpc.codec), never pickled."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from disagg.kv_transfer.layout import KVLayout, KVRank
from disagg.request import SamplingParams, StructuredOutput


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
    request_fault: bool = False  # the error is the request's own (a step failed on it): not migrated
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
    predicted_ttft_s: float = 0.0  # set by the router: what it predicted there (0: no prediction)
    predicted_tpot_s: float = 0.0

    def merge(self, later: "TokenDelta") -> None:
        """Fold a later delta of the same request into this one (the consumer was slow): tokens
        add up, every other field is the later one's."""
        for f in dataclasses.fields(self):
            if f.name in _ADDED_UP:
                setattr(self, f.name, getattr(self, f.name) + getattr(later, f.name))
            elif f.name not in _ROUTER_SET:
                setattr(self, f.name, getattr(later, f.name))

    @classmethod
    def failed(cls, request_id: str, error: str, request_fault: bool = False) -> "TokenDelta":
        """The last delta of a request that failed."""
        return cls(request_id, [], finished=True, finish_reason="abort", error=error, request_fault=request_fault)

    @classmethod
    def first(cls, result: "PrefillResult") -> "TokenDelta":
        """The first token, as a prefill worker answered it."""
        return cls(
            result.request_id,
            [result.token_id],
            text=result.text,
            logprobs=[result.logprob] if result.logprob is not None else [],
            finished=result.finished,
            finish_reason=result.finish_reason,
            num_prompt_tokens=result.num_prompt_tokens,
            num_cached_tokens=result.num_cached_tokens,
            num_output_tokens=1,
            queue_s=result.queue_s,
            prefill_s=result.prefill_s,
        )


_ADDED_UP = {"token_ids", "text", "logprobs"}
_ROUTER_SET = {"request_id", "prefill_instance", "decode_instance", "predicted_ttft_s", "predicted_tpot_s"}


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


# Every class a request link's frame may hold (disagg.rpc.framing).
MESSAGE_TYPES = (TokenDelta, PrefillResult, Reservation, KVLayout, KVRank, SamplingParams, StructuredOutput)
