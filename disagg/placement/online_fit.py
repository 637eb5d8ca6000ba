"""An instance's step model, refitted online from the steps it reports.

Workers time every engine step and report what it computed (`StepSample`) with their load. The
router keeps a sliding window of each instance's samples and refits DistServe's forms on it
(disagg.placement.latency_model): prefill steps a + b*tokens + c*attention, decode steps
a + b*context + c*batch. Until a kind of step has enough samples, the seed's coefficients hold
(a profile, or a neutral guess), so an instance is predicted from its first request on and
by its own measurements soon after. Each sample is predicted before it is learnt from: those
errors are the model's honest recent error, shown in metrics and ClusterStatus.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from disagg.placement.fitting import least_squares, median
from disagg.placement.latency_model import Coefficients, StepModel

MIN_SAMPLES = 8  # of one kind, before its fit replaces the seed's coefficients
# Before an instance has reported anything: a guess of the right order for a small model on a
# CPU, used only until the first fit (the router does not refuse requests on it, see `calibrated`).
NEUTRAL_SEED = StepModel(Coefficients(10.0, 0.2, 1e-5), Coefficients(10.0, 0.005, 0.5), Coefficients(10.0, 0.005, 0.5))


@dataclass(frozen=True)
class StepSample:
    """One engine step as a worker measured it."""

    prefill_tokens: int  # prompt tokens computed (all chunks)
    prefill_attention: int  # sum over chunks of n * (2 * start + n) (latency_model.Chunk.attention)
    decode_batch: int  # requests decoding one token
    decode_context: int  # their contexts, summed
    ms: float

    def to_list(self) -> list:
        return [self.prefill_tokens, self.prefill_attention, self.decode_batch, self.decode_context, round(self.ms, 3)]

    @classmethod
    def from_list(cls, values) -> "StepSample":
        tokens, attention, batch, context, ms = values
        return cls(int(tokens), int(attention), int(batch), int(context), float(ms))

    @property
    def kind(self) -> str:
        if self.prefill_tokens and self.decode_batch:
            return "mixed"
        return "prefill" if self.prefill_tokens else "decode"


def predict(model: StepModel, sample: StepSample) -> float:
    """What `model` says the sample's step takes, in ms."""
    prefill = model.prefill(sample.prefill_tokens, sample.prefill_attention) if sample.prefill_tokens else 0.0
    if not sample.decode_batch:
        return prefill
    decode = model.decode_ms(sample.decode_batch, sample.decode_context)
    if not sample.prefill_tokens:
        return decode
    return prefill + decode - min(model.prefill.a, model.decode_small.a)  # one step, one intercept


class OnlineStepModel:
    def __init__(
        self,
        seed: StepModel = NEUTRAL_SEED,
        window: int = 256,
        refit_every: int = 8,
        error_window: int = 64,
        seeded_from_profile: bool = False,
    ):
        self.seed = seed
        self.seeded_from_profile = seeded_from_profile
        self.model = seed
        self.refit_every = refit_every
        self._samples: dict[str, deque[StepSample]] = {k: deque(maxlen=window) for k in ("prefill", "decode")}
        self._errors: deque[float] = deque(maxlen=error_window)
        self._since_refit = 0
        self.num_samples = 0

    def observe(self, sample: StepSample) -> None:
        if sample.ms <= 0 or not (sample.prefill_tokens or sample.decode_batch):
            return
        self._errors.append(abs(predict(self.model, sample) - sample.ms) / sample.ms)
        self.num_samples += 1
        if sample.kind in self._samples:
            self._samples[sample.kind].append(sample)
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self._since_refit = 0
            self.model = self._refit()

    def forget(self) -> None:
        """Back to the seed: what was learnt so far is not representative (e.g. steps that
        built kernels for shapes seen the first time)."""
        self.model = self.seed
        for samples in self._samples.values():
            samples.clear()
        self._errors.clear()
        self._since_refit = self.num_samples = 0

    def calibrated(self, kind: str) -> bool:
        """Whether steps of `kind` ("prefill" or "decode") are predicted from this instance's own
        measurements (or from a profile given as the seed, `seeded_from_profile`)."""
        return self.seeded_from_profile or len(self._samples[kind]) >= MIN_SAMPLES

    def recent_error(self) -> float | None:
        """Median relative error of the last predictions (None before any)."""
        return median(list(self._errors)) if self._errors else None

    def _refit(self) -> StepModel:
        prefill = self._fit("prefill", lambda s: [1.0, s.prefill_tokens, s.prefill_attention], self.model.prefill)
        decode = self._fit("decode", lambda s: [1.0, s.decode_context, s.decode_batch], self.model.decode_small)
        # One decode triple online: the batches one instance runs rarely span DistServe's split.
        return StepModel(prefill, decode, decode, self.model.decode_threshold)

    def _fit(self, kind: str, row, current: Coefficients) -> Coefficients:
        samples = list(self._samples[kind])
        if len(samples) < MIN_SAMPLES:
            return current
        rows = [row(s) for s in samples]
        targets = [s.ms for s in samples]
        fitted = Coefficients(*_nonnegative_slopes(rows, targets))
        if _median_error(fitted, rows, targets) > _median_error(current, rows, targets):
            return current  # e.g. too little variety in the window to pin three terms down
        return fitted


def _nonnegative_slopes(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares whose per-token and per-request terms are not negative: a window of a few
    similar steps can fit "more requests, faster steps", and the policy would then crowd every
    request onto the busiest instance. A negative term is dropped and the rest refitted."""
    kept = [0, 1, 2]
    while True:
        solution = least_squares([[r[j] for j in kept] for r in rows], targets)
        w = dict(zip(kept, solution))
        negative = [j for j in kept[1:] if w[j] < 0]
        if not negative:
            return [w.get(j, 0.0) for j in range(3)]
        kept.remove(min(negative, key=lambda j: w[j]))


def _median_error(c: Coefficients, rows: list[list[float]], targets: list[float]) -> float:
    return median([abs(c(r[1], r[2]) - y) / y for r, y in zip(rows, targets)])
