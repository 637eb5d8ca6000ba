"""A request's TTFT and TPOT on a given pair of instances, predicted from their step models.

TTFT on prefill instance P: the steps P runs from now until the prompt's first token
(disagg.placement.prefill_queue): the prompts queued there (each with its own length and cached
prefix, so their attention and step count are priced), any backlog P reported beyond them, then
this prompt's uncached tokens, packed under P's token budget as its scheduler packs them (fair
prefill's cap included: a short prompt shares the steps of a long one ahead of it); where P
decodes too, each step is the mixed step it will be, with P's decode batch riding along. Less
what P has already spent on its queue, but never less than this prompt's own steps after the rest
of the step under way. What the step model does not see (the router's and the link's own time,
the KV's last layer on its way) is the instance's measured residual.

TPOT on decode instance D: one decode step of D's batch with this request added, every context
grown by half of this request's output (its average over the request's life), plus D's residual.

Pure: the router predicts with live instances, the simulator with simulated ones.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from disagg.placement.latency_model import StepModel
from disagg.placement.prefill_queue import Decodes, PrefillForecast, QueuedPrompt, forecast

MAX_BACKLOG_PROMPTS = 256  # a reported backlog is priced as at most this many prompts
SEED_WEIGHT = 0.5  # the residual's seed counts as an error this heavy (the newest weighs 1)


class PrefillSide(Protocol):
    instance_id: str
    step_model: StepModel
    prefill_budget: int  # max tokens a step computes
    prefill_chunk_cap: int | None  # a prompt chunk's first share of a step (fair prefill); None: no cap
    prefill_by_work: bool  # whether that cap, and a step's rest, count work (EngineConfig.long_prefill_by_work)
    prefill_calibrated: bool  # predicted from its own measurements (else a guess: refuse nothing on it)

    @property
    def queued_prompts(self) -> Sequence[QueuedPrompt]: ...  # to compute before a new one, in order

    @property
    def queue_progress_ms(self) -> float: ...  # how long it has worked on them (0: not started)

    @property
    def backlog_tokens(self) -> int: ...  # prompt tokens queued there beyond those (of unknown prompts)

    @property
    def riding_decodes(self) -> Decodes | None: ...  # the batch sharing its steps; None: it only prefills

    @property
    def arriving_tokens_per_ms(self) -> float: ...  # uncached prompt tokens coming to it, of late

    @property
    def predicted_queue_tokens(self) -> int: ...  # prompt tokens to compute before a new one

    def cached_tokens(self, block_hashes: list[int]) -> int:
        """Tokens of a prompt (its block hashes) that it holds in its prefix cache."""

    def ttft_residual_ms(self, model_ms: float) -> float:
        """What its TTFT predictions miss (`Residual.value_for`)."""


class DecodeSide(Protocol):
    instance_id: str
    step_model: StepModel
    decode_calibrated: bool

    @property
    def decode_batch(self) -> int: ...  # requests decoding, or about to

    @property
    def decode_context_tokens(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    def tpot_residual_ms(self, model_ms: float) -> float:
        """What its TPOT predictions miss (`Residual.value_for`)."""


@dataclass(frozen=True)
class Predicted:
    """A prediction: the step model's part, and the instance's residual on top; never less than
    one step (`floor_ms`)."""

    model_ms: float  # what the residual learns against: it is what the model alone misses
    residual_ms: float
    floor_ms: float
    wait_ms: float = 0.0  # a TTFT's wait for room on the decode side (disagg.router.decode_room)

    @property
    def ms(self) -> float:
        return max(self.model_ms + self.residual_ms, self.floor_ms) + self.wait_ms


def ttft(prefill: PrefillSide, prompt_tokens: int, cached_tokens: int = 0, model: StepModel | None = None) -> Predicted:
    """From now until the prompt's first token is back, on `prefill`; priced by `model` (by
    default its own)."""
    model = model or prefill.step_model
    compute = prefill_forecast(prefill, prompt_tokens, cached_tokens, model).ms
    return Predicted(compute, prefill.ttft_residual_ms(compute), model.prefill.a)


def ttft_ms(prefill: PrefillSide, prompt_tokens: int, cached_tokens: int = 0, model: StepModel | None = None) -> float:
    return ttft(prefill, prompt_tokens, cached_tokens, model).ms


def prefill_forecast(
    prefill: PrefillSide, prompt_tokens: int, cached_tokens: int = 0, model: StepModel | None = None
) -> PrefillForecast:
    """The steps `prefill` runs until the prompt's first token, priced by `model` (by default its
    own). A prompt always computes its last token (it is sampled from), cached or not."""
    cached = min(max(0, cached_tokens), max(0, prompt_tokens - 1))
    queue = [*_unknown_prompts(prefill.backlog_tokens, prompt_tokens), *prefill.queued_prompts]
    prompt = QueuedPrompt(prompt_tokens, cached)
    model = model or prefill.step_model
    return forecast(model, queue, prompt, prefill.prefill_budget, prefill.riding_decodes, prefill.queue_progress_ms,
                    prefill.arriving_tokens_per_ms, prefill.prefill_chunk_cap, prefill.prefill_by_work)  # fmt: skip


def _unknown_prompts(tokens: int, like: int) -> list[QueuedPrompt]:
    """A backlog whose prompts are not known here, taken as prompts as long as the new one."""
    if tokens <= 0:
        return []
    count = min(MAX_BACKLOG_PROMPTS, -(-tokens // max(1, like)))
    size, extra = divmod(tokens, count)
    return [QueuedPrompt(size + (i < extra)) for i in range(count)]


def tpot(decode: DecodeSide, prompt_tokens: int, output_tokens: int) -> Predicted:
    """Time per output token of a request joining `decode`'s batch now, which it is expected
    to leave after `output_tokens` (its max_tokens, or a predicted length)."""
    batch = decode.decode_batch + 1
    context = decode.decode_context_tokens + prompt_tokens + batch * output_tokens // 2
    model, step = decode.step_model, decode.step_model.decode_ms(batch, context)
    return Predicted(step, decode.tpot_residual_ms(step), model.decode_small.a)


def tpot_ms(decode: DecodeSide, prompt_tokens: int, output_tokens: int) -> float:
    return tpot(decode, prompt_tokens, output_tokens).ms


class Residual:
    """Measured minus predicted: what a prediction misses on one instance (ms), for a prediction
    of a given size. A weighted median of the recent errors: a median, so that an outlier (a
    first request, building kernels) moves nothing; weights that halve with every `half_life`
    errors observed after one and every `half_life_s` seconds it is older than the newest, so
    that a shift is followed within about `half_life` requests, and at once after a pause; and
    weights in proportion to how alike the predictions were (the smaller over the larger), so
    that the errors of a saturation episode, whose predictions were many times longer, hardly
    count for the requests after it. Its seed counts too, as an error of weight SEED_WEIGHT
    alike any prediction: where no recent error is alike, the seed holds, not an unlike error."""

    def __init__(self, seed_ms: float = 0.0, half_life: float = 4.0, half_life_s: float = 10.0, window: int = 32):
        """`seed_ms`: the value until its first observation, and where no error is alike (a new
        instance takes its pool peers' residual: what the model misses there, the router's and
        link's own time, it misses here too; a new instance at 0 would look faster than its
        peers and take all)."""
        self.half_life, self.half_life_s = half_life, half_life_s
        self._errors: deque[tuple[float, float, float]] = deque(maxlen=window)  # (error, model's prediction, when)
        self._recency: list[float] = []  # each error's weight for being recent
        self._seed = seed_ms

    def observe(self, measured_ms: float, predicted_ms: float, now: float | None = None) -> None:
        """`predicted_ms`: the model's part (`Predicted.model_ms`), without the residual: a
        prediction held up by its floor would otherwise teach the residual a false error, and
        keep it there. `now`: time.monotonic() by default."""
        error = measured_ms - predicted_ms
        if not math.isfinite(error):
            return
        now = time.monotonic() if now is None else now
        self._errors.append((error, predicted_ms, now))
        newest = len(self._errors) - 1
        self._recency = [0.5 ** ((newest - i) / self.half_life + (now - t) / self.half_life_s)
                         for i, (_, _, t) in enumerate(self._errors)]  # fmt: skip

    def value_for(self, model_ms: float) -> float:
        """For a prediction whose model part is `model_ms`."""
        weighted = [(e, r * _likeness(m, model_ms)) for (e, m, _), r in zip(self._errors, self._recency)]
        return _weighted_median([(self._seed, SEED_WEIGHT), *weighted])

    @property
    def value(self) -> float:
        """For a prediction like the newest one (what a new peer is seeded with)."""
        return self.value_for(self._errors[-1][1] if self._errors else 0.0)


def _likeness(a_ms: float, b_ms: float) -> float:
    """1 for predictions of the same size, 1/k for one k times the other."""
    low, high = sorted((max(a_ms, 1.0), max(b_ms, 1.0)))
    return low / high


def _weighted_median(pairs: list[tuple[float, float]]) -> float:
    """The smallest value with at least half of the total weight at or below it."""
    ordered = sorted(pairs)
    half, total = sum(w for _, w in ordered) / 2, 0.0
    for value, weight in ordered:
        total += weight
        if total >= half:
            return value
    return ordered[-1][0]
