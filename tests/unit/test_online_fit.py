"""The router's online fit (disagg.placement.online_fit) learns every kind of step, mixed ones
(chunked prefill with decodes) included, in the latency model's "sum" form."""

from __future__ import annotations

import random

import pytest

from disagg.placement.latency_model import Coefficients, StepModel
from disagg.placement.online_fit import MIN_SAMPLES, NEUTRAL_SEED, OnlineStepModel
from disagg.step_work import Chunk, MeasuredStep, StepWork

# ms: prefill 5 + 0.1/token + 1e-4 * attention; decode 3 + 0.001/context token + 0.2/request
TRUE = StepModel(Coefficients(5.0, 0.1, 1e-4), Coefficients(3.0, 0.001, 0.2), Coefficients(3.0, 0.001, 0.2))


def _work(rng: random.Random, kind: str) -> StepWork:
    chunks = (Chunk(rng.choice([0, 0, 256, 1024]), rng.randint(16, 512)),) if kind != "decode" else ()
    decodes = rng.randint(1, 48) if kind != "prefill" else 0
    return StepWork(chunks, decodes, decodes * rng.randint(50, 2000))


def _steps(kinds: list[str], seed: int = 0, noise: float = 0.0) -> list[MeasuredStep]:
    """Steps of these kinds, timed by TRUE (times 1 +- noise)."""
    rng = random.Random(seed)
    steps = []
    for kind in kinds:
        work = _work(rng, kind)
        steps.append(MeasuredStep(work, TRUE.step_ms(work) * (1 + rng.uniform(-noise, noise))))
    return steps


def _learnt(steps: list[MeasuredStep], seed: StepModel = NEUTRAL_SEED) -> OnlineStepModel:
    online = OnlineStepModel(seed, refit_every=8)
    for step in steps:
        online.observe(step)
    return online


def test_a_stream_of_mixed_steps_alone_is_learnt():
    """A colocated chunked-prefill instance under load: nearly every step is mixed."""
    online = _learnt(_steps(["mixed"] * 96, noise=0.02), seed=TRUE.scaled(3.0))
    assert online.calibrated("prefill") and online.calibrated("decode")
    assert online.recent_error() < 0.04
    for step in _steps(["mixed"] * 40, seed=1):  # held out
        assert online.model.step_ms(step.work) == pytest.approx(step.ms, rel=0.05)


def test_prefill_decode_and_mixed_steps_recover_the_coefficients():
    online = _learnt(_steps(["prefill", "decode", "mixed"] * 30))
    model = online.model
    assert model.mixed_form == "sum"
    assert model.prefill.to_list() == pytest.approx(TRUE.prefill.to_list(), rel=1e-6)
    assert model.decode_small.to_list() == pytest.approx(TRUE.decode_small.to_list(), rel=1e-6)
    assert online.recent_error() == pytest.approx(0.0, abs=1e-6)


def test_mixed_steps_teach_the_decode_slopes_of_an_instance_that_never_decodes_alone():
    online = _learnt(_steps(["prefill", "mixed"] * 48))
    model = online.model
    assert model.prefill.to_list() == pytest.approx(TRUE.prefill.to_list(), rel=1e-6)
    assert (model.decode_small.b, model.decode_small.c) == pytest.approx((TRUE.decode_small.b, TRUE.decode_small.c))
    # no decode-only step was measured: its fixed cost is taken to be any step's, the prefill's
    assert model.decode_small.a == pytest.approx(TRUE.prefill.a)


def test_a_kind_with_too_few_steps_keeps_the_seeds_terms():
    seed = TRUE.scaled(2.0)
    online = _learnt(_steps(["decode"] * 40 + ["mixed"] * (MIN_SAMPLES - 1)), seed=seed)
    assert not online.calibrated("prefill") and online.calibrated("decode")
    assert online.model.prefill == seed.prefill  # the few mixed steps wait for enough of their kind
    assert online.model.decode_small.to_list() == pytest.approx(TRUE.decode_small.to_list(), rel=1e-6)
    prefill_only = _learnt(_steps(["prefill"] * 40), seed=seed)
    assert prefill_only.model.decode_small == seed.decode_small and not prefill_only.calibrated("decode")


def test_a_mixed_step_counts_towards_both_kinds_calibration():
    online = _learnt(_steps(["mixed"] * (MIN_SAMPLES - 1)))
    assert not online.calibrated("prefill") and not online.calibrated("decode")
    online.observe(_steps(["mixed"], seed=3)[0])
    assert online.calibrated("prefill") and online.calibrated("decode")


@pytest.mark.parametrize("bad_ms", [float("nan"), float("inf")])
def test_a_step_timed_as_no_number_teaches_nothing(bad_ms):
    """One such step in the window would make every later fit NaN (0 * inf in the normal
    equations), and every prediction on the instance with it."""
    steps = _steps(["prefill", "decode", "mixed"] * 30)
    poisoned = [*steps[:40], steps[40].with_ms(bad_ms), *steps[40:]]
    model = _learnt(poisoned).model
    assert model.prefill.to_list() == pytest.approx(TRUE.prefill.to_list(), rel=1e-6)
    assert model.decode_small.to_list() == pytest.approx(TRUE.decode_small.to_list(), rel=1e-6)
