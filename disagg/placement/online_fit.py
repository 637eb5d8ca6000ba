"""An instance's step model, refitted online from the steps it reports.

Workers time every engine step and report it with their load: what it computed and how long it
took (`disagg.step_work.MeasuredStep`). The router keeps a sliding window of each instance's steps,
one per kind, and refits the latency model's "sum" form (disagg.placement.latency_model) on all of
them at once, one least squares over the six terms of `fitting.joint_row`:

  prefill step  a_p + b*tokens + c*attention
  decode step   a_d + d*context + e*batch
  mixed step    a_p + b*tokens + c*attention + d*context + e*batch

so the mixed steps of a colocated instance (chunked prefill with decodes, most of its steps) teach
both kinds' terms. A kind's terms are fitted once MIN_SAMPLES steps carry its work (a mixed step
carries both); until then the seed's hold (a profile, or a neutral guess), so an instance is
predicted from its first request on and by its own measurements soon after. Each step is
predicted before it is learnt from: those errors are the model's honest recent error, shown in
metrics and ClusterStatus.
"""

from __future__ import annotations

import math
from collections import deque

from disagg.placement.fitting import (
    JOINT_INTERCEPTS,
    JOINT_TERMS,
    joint_coefficients,
    joint_row,
    median,
    nonnegative_least_squares,
)
from disagg.placement.latency_model import Coefficients, StepModel
from disagg.step_work import MeasuredStep

MIN_SAMPLES = 8  # steps carrying a kind's work, before its fit replaces the seed's coefficients
KINDS = ("prefill", "decode", "mixed")
# Before an instance has reported anything: a guess of the right order for a small model on a
# CPU, used only until the first fit (the router does not refuse requests on it, see `calibrated`).
NEUTRAL_SEED = StepModel(Coefficients(10.0, 0.2, 1e-5), Coefficients(10.0, 0.005, 0.5), Coefficients(10.0, 0.005, 0.5))


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
        self._steps: dict[str, deque[MeasuredStep]] = {kind: deque(maxlen=window) for kind in KINDS}
        self._errors: deque[float] = deque(maxlen=error_window)
        self._since_refit = 0
        self.num_samples = 0

    def observe(self, step: MeasuredStep) -> None:
        if not (0 < step.ms < math.inf) or step.work.is_empty:  # (NaN too: it would poison every fit)
            return
        self._errors.append(abs(self.model.step_ms(step.work) - step.ms) / step.ms)
        self.num_samples += 1
        self._steps[step.work.kind].append(step)
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self._since_refit = 0
            self.model = self._refit()

    def forget(self) -> None:
        """Back to the seed: what was learnt so far is not representative (e.g. steps that
        built kernels for shapes seen the first time)."""
        self.model = self.seed
        for steps in self._steps.values():
            steps.clear()
        self._errors.clear()
        self._since_refit = self.num_samples = 0

    def calibrated(self, kind: str) -> bool:
        """Whether steps of `kind` ("prefill" or "decode") are predicted from this instance's own
        measurements (or from a profile given as the seed, `seeded_from_profile`). A mixed step
        counts for both: the joint fit pins both kinds' terms on it. (Until a decode-only step is
        seen, a decode step's intercept is taken to be the prefill's: what any step costs.)"""
        return self.seeded_from_profile or self._num_carrying(kind) >= MIN_SAMPLES

    def recent_error(self) -> float | None:
        """Median relative error of the last predictions (None before any)."""
        return median(list(self._errors)) if self._errors else None

    def _num_carrying(self, kind: str) -> int:
        """Steps in the window that computed work of `kind`."""
        return len(self._steps[kind]) + len(self._steps["mixed"])

    def _refit(self) -> StepModel:
        fits = {kind: self._num_carrying(kind) >= MIN_SAMPLES for kind in ("prefill", "decode")}
        fits["mixed"] = fits["prefill"] and fits["decode"]
        # A kind not fitted yet keeps its terms: the steps that carry its work wait in the window.
        steps = [step for kind in KINDS if fits[kind] for step in self._steps[kind]]
        weights = _fit_joint(steps, self.model)
        if weights is None or not all(math.isfinite(w) for w in weights.values()):
            return self.model  # (an ill-conditioned window can overflow: such a fit predicts nothing)
        fitted = _joint_model(self.model, weights, fits)
        if _median_error(fitted, steps) > _median_error(self.model, steps):
            return self.model  # e.g. too little variety in the window to pin the terms down
        return fitted


def _fit_joint(steps: list[MeasuredStep], current: StepModel) -> dict[int, float] | None:
    """{index in JOINT_TERMS: coefficient} of the terms some step has (the others cannot be
    fitted), or None when the steps are too few to determine them. A mixture of experts' expert
    reads (`current.experts`, not linear in the tokens) are taken out of each step's time first
    and kept as they are."""
    rows = [joint_row(step.work) for step in steps]
    terms = [j for j in range(len(JOINT_TERMS)) if any(row[j] for row in rows)]
    if not steps or len(steps) < len(terms):
        return None
    solved = nonnegative_least_squares(
        [[row[j] for j in terms] for row in rows],
        [step.ms - current.expert_ms(step.work.prefill_tokens + step.work.num_decodes) for step in steps],
        free=[i for i, j in enumerate(terms) if j in JOINT_INTERCEPTS],
    )
    return dict(zip(terms, solved))


def _joint_model(current: StepModel, w: dict[int, float], fits: dict[str, bool]) -> StepModel:
    """The fitted terms (by their index in JOINT_TERMS) in StepModel's "sum" form; a kind not
    fitted keeps `current`'s."""
    if 1 not in w:  # no decode-only step in the window: its fixed cost is taken as any step's
        w = {**w, 1: w.get(0, current.decode_small.a)}
    prefill, decode = joint_coefficients([w.get(j, 0.0) for j in range(len(JOINT_TERMS))])
    prefill = prefill if fits["prefill"] else current.prefill
    if not fits["decode"]:
        return StepModel(
            prefill, current.decode_small, current.decode_large, current.decode_threshold, experts=current.experts
        )
    # One decode triple online: the batches one instance runs rarely span DistServe's split.
    return StepModel(prefill, decode, decode, current.decode_threshold, experts=current.experts)


def _median_error(model: StepModel, steps: list[MeasuredStep]) -> float:
    return median([abs(model.step_ms(step.work) - step.ms) / step.ms for step in steps])
