"""A request's state as it moves through an engine: plain data, no torch.

Names follow vLLM (SamplingParams, RequestStatus, FinishReason) so that users feel at home.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Any

from disagg.errors import InvalidRequestError

MAX_STOP_STRINGS = 64  # vLLM and SGLang set no bound; a stop list costs engine time per token
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# A grammar is compiled on the engine thread: its text is bounded so that one request cannot stall a batch.
MAX_GRAMMAR_CHARS = 64 * 1024
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")
# A request's priority as the engine orders it, vLLM's convention: a lower value is served
# earlier, 0 is the default. Our API's names are three of these values.
PRIORITY_VALUES = {"critical": -1, "standard": 0, "sheddable": 1}


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller, or failed

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_KV = enum.auto()  # DECODE role: blocks reserved, KV not yet imported
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # blocks taken back; recomputed when rescheduled
    PAUSED = enum.auto()  # out of the batch, blocks kept: its KV is moving to another instance
    SUSPENDED = enum.auto()  # out of the batch, blocks kept: a more urgent request took its slot
    HELD_FOR_EXPORT = enum.auto()  # PREFILL role: first token out, blocks kept until the KV is exported
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar every output token must follow (disagg.engine.grammar compiles it).

    kind: json_object (any JSON object; spec empty), json_schema (spec: the schema as JSON
    text), regex, grammar (EBNF: llama.cpp's GBNF or Lark), choice (spec: a JSON list of the
    strings allowed)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        _check(
            self.kind in STRUCTURED_KINDS, "structured", f"kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}"
        )
        _check(isinstance(self.spec, str), "structured", "spec must be a string")
        _check(len(self.spec) <= MAX_GRAMMAR_CHARS, "structured", f"spec: at most {MAX_GRAMMAR_CHARS} characters")
        _check(self.kind == "json_object" or self.spec.strip() != "", "structured", f"{self.kind} needs a spec")


@dataclass
class SamplingParams:
    """How to pick each next token. temperature=0.0 means greedy (vLLM's convention)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: chosen token only; n: chosen + top n
    include_stop_str_in_output: bool = False
    # Tokens of this request generated before it came here (a request migrated from a failed
    # instance resumes with them appended to its prompt): its seeded stream continues at this index.
    resumed_tokens: int = 0
    structured: StructuredOutput | None = None  # a grammar the output follows (structured output)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        _check(
            _is_number(self.temperature) and self.temperature >= 0,
            "temperature",
            f"must be >= 0, got {self.temperature!r}",
        )
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(
            _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0),
            "top_k",
            f"must be -1 (off), 0 (off) or >= 1, got {self.top_k!r}",
        )
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(self.seed is None or _is_int(self.seed), "seed", f"must be an integer or None, got {self.seed!r}")
        _check(
            _is_int(self.resumed_tokens) and self.resumed_tokens >= 0,
            "resumed_tokens",
            f"must be an integer >= 0, got {self.resumed_tokens!r}",
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        # Stop-string matching costs grow with their number and length, on the engine thread.
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} strings")
        _check(
            all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
            "stop",
            f"each at most {MAX_STOP_STRING_CHARS} characters",
        )
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS}")
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative integers"
        )
        _check(
            self.structured is None or isinstance(self.structured, StructuredOutput),
            "structured",
            "must be a StructuredOutput or None",
        )
        _check(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            f"must be None or an integer in [0, 20], got {self.logprobs!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def jumps_forward(self) -> bool:
        """Whether tokens its grammar forces may be appended without sampling them: not when
        each token's logprob is asked for (a forced token has none)."""
        return self.structured is not None and self.logprobs is None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """A finite real number (NaN and infinities fail)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)


@dataclass
class RequestTimings:
    """Wall-clock timestamps (time.perf_counter based) of the phases of one request."""

    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    kv_ready: float | None = None  # DECODE role: KV imported
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    # The per-phase durations a worker reports (it measures on its own clock; `now` ends a phase
    # still under way).
    def queue_seconds(self) -> float:
        return (self.first_scheduled or self.arrival) - self.arrival

    def prefill_seconds(self, now: float) -> float:
        return (self.first_token or now) - (self.first_scheduled or self.arrival)

    def decode_seconds(self, now: float) -> float:
        """From the first token (or the KV's arrival, on a decode instance) to the end."""
        return (self.finished or now) - (self.kv_ready or self.first_token or self.arrival)


@dataclass(eq=False)
class Request:
    """One generation request inside an engine.

    `token_ids` is prompt + output so far; `num_computed_tokens` of them have KV in the cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.perf_counter)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Its first block_ids entries that are placeholders: blocks released once out of a sliding
    # window (disagg.engine.block_manager), or never held here (their KV stayed elsewhere).
    num_released_blocks: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    stop_reason: int | str | None = None
    timings: RequestTimings = field(default_factory=RequestTimings)
    priority: int = 0  # lower is served earlier (PRIORITY_VALUES)
    # A guess at how many tokens it will output (a ranker's, issue 39): what `scheduling_order:
    # ltr` orders by. None: no guess.
    predicted_output_len: int | None = None
    # When it entered this engine's scheduler, on the scheduler's clock: its wait since raises its
    # priority (disagg.engine.queue_order). Kept across preemptions; moved when it is suspended
    # (it waits from then, with the rise it had earned).
    queued_at: float | None = None
    # The priority it holds its batch slot at: its own, raised by what it had waited when it got
    # the slot (disagg.engine.queue_order.held_priority). None while it holds none.
    held_priority: float | None = None
    # What the engine's outputs need of it (disagg.engine.engine): the text it came as (None: token
    # ids), its incremental detokenizer (None: the model has no tokenizer), and how many of its
    # output tokens earlier outputs carried.
    prompt: str | None = None
    detokenizer: Any = None
    num_reported: int = 0
    # The chained hashes of its full blocks so far (disagg.engine.block_manager), and a structured
    # request's grammar state (disagg.engine.guided_decoding; None until its first masked step).
    block_hashes: list[int] = field(default_factory=list)
    guide: Any = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.timings.arrival = self.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    def append_output_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)


def priority_value(priority: int | str) -> int:
    """The engine's priority for our name of one (critical | standard | sheddable) or vLLM's
    integer (lower is earlier)."""
    if isinstance(priority, str) and priority in PRIORITY_VALUES:
        return PRIORITY_VALUES[priority]
    _check(
        _is_int(priority), "priority", f"must be one of {', '.join(PRIORITY_VALUES)} or an integer, got {priority!r}"
    )
    return priority


def check_fits(
    num_prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    field_prefix: str = "",
    max_blocks_held: int | None = None,
) -> None:
    """Refuse a request that could never run: its prompt, or prompt + max_tokens, exceeds the
    model's context or the KV cache (`num_blocks` of `block_size` tokens). The engine and the
    router's validation both ask this (the router names the field `sampling.max_tokens`).
    `max_blocks_held`: the most blocks the request holds at once, where a sliding window
    releases the others as it goes (None: every block of its tokens)."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            "prompt", f"{num_prompt_tokens} tokens do not fit the model's context ({max_model_len} tokens)"
        )
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"{field_prefix}max_tokens",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's context ({max_model_len} tokens)",
        )
    needed = -(-(num_prompt_tokens + max_tokens) // block_size)
    if max_blocks_held is not None:
        needed = min(needed, max_blocks_held)
    if needed > num_blocks:
        raise InvalidRequestError(
            f"{field_prefix}max_tokens",
            f"prompt + max_tokens needs {needed} KV blocks; an instance's cache holds {num_blocks}",
        )
