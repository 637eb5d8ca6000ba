"""The latency model's least squares (placement/fitting.py) and the profile's fit with held-out
errors (profiling/fit.py), on synthetic steps of known coefficients."""

from __future__ import annotations

import random

import pytest

from disagg.placement.fitting import fit_decode, fit_mixed, fit_prefill, least_squares
from disagg.placement.latency_model import Coefficients, StepModel
from disagg.profiling.fit import fit_shape, split_held_out
from disagg.step_work import Chunk, MeasuredStep, StepWork

PREFILL = Coefficients(12.0, 0.9, 3e-4)
DECODE = Coefficients(18.0, 2e-3, 0.6)
MIXED = (15.0, 0.8, 2.5e-4, 1.5e-3, 0.9)


def close(got, want, rel=1e-7):
    return all(g == pytest.approx(w, rel=rel, abs=1e-12) for g, w in zip(got, want, strict=True))


def timed(model: StepModel, chunks=(), decodes: int = 0, context: int = 0, scale: float = 1.0) -> MeasuredStep:
    """The step of these chunks and decodes, taking what `model` says (times `scale`)."""
    work = StepWork(tuple(chunks), decodes, context)
    return MeasuredStep(work, model.step_ms(work) * scale)


def test_least_squares_recovers_prefill_coefficients():
    model = StepModel(PREFILL, DECODE, DECODE)
    batches = [[16], [128], [512], [1024], [64, 256], [32, 32, 32, 32], [300, 700]]
    samples = [timed(model, [Chunk(0, n) for n in lens]) for lens in batches]
    assert samples[4].ms == pytest.approx(PREFILL(64 + 256, 64**2 + 256**2))  # whole prompts: DistServe's l^2
    assert close(fit_prefill(samples).to_list(), PREFILL.to_list())


def test_least_squares_recovers_decode_coefficients():
    model = StepModel(PREFILL, DECODE, DECODE)
    samples = [timed(model, (), b, b * ctx) for b in (1, 4, 16, 64) for ctx in (100, 900)]
    assert close(fit_decode(samples).to_list(), DECODE.to_list())


def test_least_squares_recovers_mixed_coefficients():
    model = StepModel(PREFILL, DECODE, DECODE, mixed_form="fit", mixed=MIXED)
    samples = []
    for decodes, ctx_sum in ((2, 700), (8, 2500), (32, 9000)):  # chunks alone are a prefill step
        for chunk in (Chunk(0, 64), Chunk(128, 64), Chunk(256, 256), Chunk(512, 128)):
            samples.append(timed(model, [chunk], decodes, ctx_sum))
    assert close(fit_mixed(samples), MIXED, rel=1e-6)


def test_a_mixed_step_of_the_sum_form_costs_its_prefill_plus_the_decodes_slopes():
    model = StepModel(PREFILL, DECODE, DECODE)
    chunk, decodes, context = Chunk(128, 64), 8, 2500
    mixed = model.step_ms(StepWork((chunk,), decodes, context))
    assert mixed == pytest.approx(PREFILL(64, chunk.attention) + DECODE.b * context + DECODE.c * decodes)
    # one step, one intercept: the prefill's
    assert mixed == pytest.approx(
        model.step_ms(StepWork((chunk,))) + model.step_ms(StepWork((), decodes, context)) - DECODE.a
    )


def test_relative_weighting_minimises_relative_error():
    # y = 1 + x except one large step measured 20% high: an absolute fit bends towards the large
    # step, a relative one stays with the many small ones.
    rows = [[1.0, x] for x in (1, 2, 3, 4, 100)]
    targets = [2.0, 3.0, 4.0, 5.0, 121.2]

    def relative_sse(w):
        return sum(((w[0] + w[1] * r[1]) - y) ** 2 / y**2 for r, y in zip(rows, targets))

    def absolute_sse(w):
        return sum(((w[0] + w[1] * r[1]) - y) ** 2 for r, y in zip(rows, targets))

    relative, absolute = least_squares(rows, targets), least_squares(rows, targets, relative=False)
    assert relative_sse(relative) < relative_sse(absolute)
    assert absolute_sse(absolute) < absolute_sse(relative)
    # each is the minimum of its own criterion: nudging it makes that worse
    for w, sse in ((relative, relative_sse), (absolute, absolute_sse)):
        for i in range(2):
            for step in (1e-3, -1e-3):
                nudged = list(w)
                nudged[i] += step * max(1.0, abs(w[i]))
                assert sse(nudged) > sse(w)


@pytest.mark.parametrize(
    "rows,targets",
    [([[1.0, 2.0, 3.0], [1.0, 4.0, 5.0]], [1.0, 2.0]), ([], []), ([[1.0, 2.0]], [1.0, 2.0])],
    ids=["fewer samples than coefficients", "no samples", "targets do not match rows"],
)
def test_least_squares_refuses_what_cannot_determine_the_fit(rows, targets):
    with pytest.raises(ValueError):
        least_squares(rows, targets)


# ---- the profile's fit ----------------------------------------------------------------------------
def synthetic_steps(model: StepModel, noise: float = 0.0, seed: int = 0) -> list[MeasuredStep]:
    """A grid like the profiler's, timed by `model` (times `1 +- noise`)."""
    rng = random.Random(seed)
    jitter = lambda: 1 + rng.uniform(-noise, noise)  # noqa: E731
    steps = []
    for lens in ([16], [64], [128], [256], [384], [512], [768], [1024], [32, 128], [128, 256], [256, 512]):
        steps.append(timed(model, [Chunk(0, n) for n in lens], scale=jitter()))
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for ctx in (64, 256, 512, 1024):
            steps.append(timed(model, (), batch, batch * ctx, scale=jitter()))
    for decodes in (0, 2, 8, 32):
        for i, chunk in enumerate((Chunk(0, 64), Chunk(128, 64), Chunk(0, 256), Chunk(256, 256), Chunk(512, 128))):
            if decodes or chunk.start:
                steps.append(timed(model, [chunk], decodes, decodes * (100 + 200 * i), scale=jitter()))
    return steps


def test_fit_shape_recovers_a_model_without_a_decode_split():
    truth = StepModel(PREFILL, DECODE, DECODE, decode_threshold=65)
    model, report = fit_shape(synthetic_steps(truth))
    assert close(model.prefill.to_list(), PREFILL.to_list(), rel=1e-6)
    assert close(model.decode_small.to_list(), DECODE.to_list(), rel=1e-6)
    assert report["prefill"]["median_abs_error_pct"] < 1e-6
    assert report["decode"]["median_abs_error_pct"] < 1e-6
    assert report["mixed"]["sum"] < 1e-6 and report["mixed"]["chosen"] == "sum"


def test_fit_shape_finds_the_decode_split():
    large = Coefficients(-40.0, 2e-3, 2.5)  # from 16 requests on, compute-bound: a steeper slope per request
    truth = StepModel(PREFILL, DECODE, large, decode_threshold=16)
    model, report = fit_shape(synthetic_steps(truth))
    assert report["decode"]["threshold"] == 16 == model.decode_threshold
    assert close(model.decode_large.to_list(), large.to_list(), rel=1e-6)
    assert report["decode"]["median_abs_error_pct"] < 1e-6


def test_fit_shape_chooses_the_fitted_mixed_form_when_steps_follow_it():
    truth = StepModel(PREFILL, DECODE, DECODE, decode_threshold=65, mixed_form="fit", mixed=MIXED)
    model, report = fit_shape(synthetic_steps(truth, noise=0.02))
    assert report["mixed"]["chosen"] == "fit" == model.mixed_form
    assert report["mixed"]["fit"] < 2.0 < report["mixed"]["sum"]
    assert close(model.mixed, MIXED, rel=0.2)


def test_held_out_steps_are_a_quarter_spread_over_the_grid():
    steps = [MeasuredStep(StepWork((), b, b), float(b)) for b in range(1, 41)]
    train, test = split_held_out(steps)
    assert len(test) == 10 and len(train) == 30
    assert {s.work.num_decodes for s in test} == set(range(3, 41, 4))


def test_fit_shape_refuses_too_few_steps():
    truth = StepModel(PREFILL, DECODE, DECODE)
    steps = [s for s in synthetic_steps(truth) if s.work.kind != "decode"][:5]
    with pytest.raises(ValueError, match="too few"):
        fit_shape(steps)


def test_a_mixed_fit_that_makes_more_work_faster_is_not_physical():
    from disagg.profiling.fit import physical

    assert physical([10.0, 1.0, 0.001, 0.01, 2.0]) and physical([-5.0, 1.0, 0.0, 0.0, 0.0])  # any intercept
    # what a grid whose decodes and contexts grow together gave (2 threads, 2026-11-25): +2.5 ms per
    # context token, -643 ms per decode; at 130 tokens of context a decode would take -317 ms
    assert not physical([520.1, 2.31, 0.0003, 2.508, -643.0])
