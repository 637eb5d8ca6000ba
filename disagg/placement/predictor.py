"""A request's TTFT and TPOT on a given pair of instances, predicted from their step models.

TTFT on prefill instance P: the prompt tokens queued at P are computed first, then this prompt,
in steps of at most P's token budget (chunked prefill); each step costs P's prefill form
a + b*tokens + c*attention, where a prompt of l tokens cut into chunks has attention l^2 in all
(the chunks' n(2s + n) add up to it). What the step model does not see (the router's and the
link's own time, the KV's last layer on its way) is the instance's measured residual.

TPOT on decode instance D: one decode step of D's batch with this request added, every context
grown by half of this request's output (its average over the request's life), plus D's residual.

Pure: the router predicts with live instances, the simulator with simulated ones.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Protocol

from disagg.placement.latency_model import StepModel


class PrefillSide(Protocol):
    instance_id: str
    step_model: StepModel
    prefill_budget: int  # max tokens a step computes
    ttft_residual_ms: float
    prefill_calibrated: bool  # predicted from its own measurements (else a guess: refuse nothing on it)

    @property
    def predicted_queue_tokens(self) -> int: ...  # prompt tokens to compute before a new one

    def cached_tokens(self, block_hashes: list[int]) -> int:
        """Tokens of a prompt (its block hashes) that it holds in its prefix cache."""


class DecodeSide(Protocol):
    instance_id: str
    step_model: StepModel
    tpot_residual_ms: float
    decode_calibrated: bool

    @property
    def decode_batch(self) -> int: ...  # requests decoding, or about to

    @property
    def decode_context_tokens(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...


def ttft_ms(prefill: PrefillSide, prompt_tokens: int, cached_tokens: int = 0) -> float:
    """From now until the prompt's first token is back, on `prefill`."""
    model = prefill.step_model
    compute = prefill_compute_ms(model, prefill.predicted_queue_tokens, prompt_tokens, prefill.prefill_budget,
                                 cached_tokens)  # fmt: skip
    return max(compute + prefill.ttft_residual_ms, model.prefill.a)  # never less than one step


def prefill_compute_ms(model: StepModel, queued_tokens: int, prompt_tokens: int, budget: int,
                       cached_tokens: int = 0) -> float:  # fmt: skip
    """The queue, then this prompt's uncached tokens, in steps of at most `budget` tokens. Its
    uncached tokens attend to the whole prompt: attention l^2 - cached^2. The queued prompts'
    own lengths are not known here: they are taken to be like this one (attention l per token)."""
    cached = min(max(0, cached_tokens), max(0, prompt_tokens - 1))
    new = prompt_tokens - cached
    queued, total = max(0, queued_tokens), max(0, queued_tokens) + new
    steps = max(1, math.ceil(total / max(1, budget)))
    p = model.prefill
    attention = prompt_tokens * prompt_tokens - cached * cached + queued * prompt_tokens
    return steps * p.a + p.b * total + p.c * attention


def tpot_ms(decode: DecodeSide, prompt_tokens: int, max_tokens: int) -> float:
    """Time per output token of a request joining `decode`'s batch now."""
    batch = decode.decode_batch + 1
    context = decode.decode_context_tokens + prompt_tokens + batch * max_tokens // 2
    model = decode.step_model
    return max(model.decode_ms(batch, context) + decode.tpot_residual_ms, model.decode_small.a)


class Residual:
    """Measured minus predicted: what a prediction misses on one instance (ms). The median of
    the last `window` requests, so that a few outliers (an instance's first requests, which
    build kernels and fill caches) do not bias every prediction after them."""

    def __init__(self, window: int = 32, seed_ms: float = 0.0):
        """`seed_ms`: the value until its first observation (a new instance takes its pool
        peers' residual: what the model misses there, the router's and link's own time, it
        misses here too; a new instance at 0 would look faster than its peers and take all)."""
        self._errors: deque[float] = deque(maxlen=window)
        self.value = seed_ms

    def observe(self, measured_ms: float, predicted_ms: float) -> None:
        """`predicted_ms` without the residual itself."""
        error = measured_ms - predicted_ms
        if math.isfinite(error):
            self._errors.append(error)
            self.value = statistics.median(self._errors)
