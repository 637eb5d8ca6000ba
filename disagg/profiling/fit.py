"""Measured steps -> one shape's `StepModel`, with its error on steps held out of the fit.

Each kind of step (`disagg.step_work.StepWork.kind`) fits its own terms: prefill steps (prompt
chunks, whole or after a start) the prefill triple, decode steps the decode triples (DistServe's
small/large batch split); mixed steps choose between the "sum" form, the one the router's online
fit learns (the prefill form of the chunks plus the decode form's per-token and per-request
terms), and a fit of their own. A quarter of each kind is held out (deterministically, spread
over the grid); the forms are compared and the decode split chosen on those, then every
coefficient is refitted on all the steps. Pure Python, like the latency model it fits.
"""

from __future__ import annotations

from collections.abc import Sequence

from disagg.placement.fitting import fit_decode, fit_mixed, fit_prefill, median, relative_errors
from disagg.placement.latency_model import Coefficients, StepModel
from disagg.step_work import MeasuredStep

HOLD_OUT_EVERY = 4  # every 4th step of a kind is held out: ~25%
MIN_POINTS_PER_TRIPLE = 4  # a decode triple fitted on fewer than this is not trusted to split on
MIN_MIXED_TRAIN = 8  # the mixed fit has five terms: fewer steps than this would fit the noise


def sample_entry(step: MeasuredStep) -> dict:
    """One measured step as the profile's report lists it."""
    work = step.work
    return {
        "chunks": [[c.start, c.num_tokens] for c in work.chunks],
        "decodes": work.num_decodes,
        "decode_context_sum": work.decode_context_sum,
        "ms": round(step.ms, 4),
    }


def split_held_out(samples: Sequence[MeasuredStep]) -> tuple[list[MeasuredStep], list[MeasuredStep]]:
    """(train, test): the 3rd of every 4 in the given order is held out, so that a grid walked
    from small to large is tested over its whole range, not only at one end."""
    train = [s for i, s in enumerate(samples) if i % HOLD_OUT_EVERY != 2]
    test = [s for i, s in enumerate(samples) if i % HOLD_OUT_EVERY == 2]
    return train, test


def by_kind(samples: Sequence[MeasuredStep]) -> dict[str, list[MeasuredStep]]:
    kinds: dict[str, list[MeasuredStep]] = {"prefill": [], "decode": [], "mixed": []}
    for s in samples:
        kinds[s.work.kind].append(s)
    return kinds


def error_pct(model: StepModel, samples: Sequence[MeasuredStep]) -> float:
    """Median absolute relative error of the model on these steps, in percent."""
    return 100 * median(relative_errors(model, samples))


# ---- each kind ----------------------------------------------------------------------------------
def prefill_coefficients(samples: Sequence[MeasuredStep]) -> Coefficients:
    return fit_prefill(samples)


def decode_split(samples: Sequence[MeasuredStep], threshold: int) -> tuple[Coefficients, Coefficients]:
    """(small, large) triples; with no batch at or above `threshold` both are the one triple."""
    small = [s for s in samples if s.work.num_decodes < threshold]
    large = [s for s in samples if s.work.num_decodes >= threshold]
    if not large:
        one = _decode_triple(small)
        return one, one
    return _decode_triple(small), _decode_triple(large)


def _decode_triple(samples: Sequence[MeasuredStep]) -> Coefficients:
    return fit_decode(samples)


def threshold_candidates(samples: Sequence[MeasuredStep]) -> list[int]:
    """Batch sizes to split at that leave both sides enough steps, then 'no split' (above the largest)."""
    batches = sorted({s.work.num_decodes for s in samples})
    ok = [
        b
        for b in batches
        if sum(s.work.num_decodes < b for s in samples) >= MIN_POINTS_PER_TRIPLE
        and sum(s.work.num_decodes >= b for s in samples) >= MIN_POINTS_PER_TRIPLE
    ]
    return ok + [batches[-1] + 1]


def mixed_coefficients(samples: Sequence[MeasuredStep]) -> tuple[float, ...]:
    return fit_mixed(samples)


# ---- one shape ----------------------------------------------------------------------------------
def fit_shape(samples: Sequence[MeasuredStep]) -> tuple[StepModel, dict]:
    """Fit on ~75% of each kind, measure on the rest, choose the decode split and the mixed form
    there; the returned model is refitted on every step with those choices."""
    kinds = by_kind(samples)
    for kind in ("prefill", "decode"):
        if len(kinds[kind]) < 2 * MIN_POINTS_PER_TRIPLE:
            raise ValueError(f"profile: {len(kinds[kind])} {kind} steps are too few to fit and test")
    split = {kind: split_held_out(steps) for kind, steps in kinds.items()}
    prefill = prefill_coefficients(split["prefill"][0])
    threshold, decode_errors = _choose_threshold(prefill, *split["decode"])
    small, large = decode_split(split["decode"][0], threshold)
    train_model = StepModel(prefill, small, large, threshold)
    report = {
        "prefill": _error_entry(train_model, *split["prefill"]),
        "decode": {
            **_error_entry(train_model, *split["decode"]),
            "threshold": threshold,
            "thresholds_tried_pct": decode_errors,
        },
    }
    form, mixed_report = _choose_mixed(train_model, *split["mixed"])
    report["mixed"] = mixed_report
    return _refit_all(kinds, threshold, form), report


def _choose_threshold(
    prefill: Coefficients, train: Sequence[MeasuredStep], test: Sequence[MeasuredStep]
) -> tuple[int, dict[str, float]]:
    errors = {}
    for threshold in threshold_candidates(train):
        small, large = decode_split(train, threshold)
        errors[threshold] = error_pct(StepModel(prefill, small, large, threshold), test)
    best = min(errors, key=lambda t: (errors[t], -t))  # a tie goes to fewer coefficients: no split
    return best, {str(t): round(e, 2) for t, e in errors.items()}


def _choose_mixed(model: StepModel, train: Sequence[MeasuredStep], test: Sequence[MeasuredStep]) -> tuple[str, dict]:
    entry = {"n_train": len(train), "n_test": len(test)}
    if len(train) < MIN_MIXED_TRAIN or not test:
        # too few mixed steps to fit five terms: the sum of the parts needs none of its own
        return "sum", {**entry, "sum": round(error_pct(model, test), 2) if test else None, "chosen": "sum"}
    mixed = mixed_coefficients(train)
    if not physical(mixed):
        return "sum", {**entry, "sum": round(error_pct(model, test), 2), "fit": "rejected", "chosen": "sum"}
    fitted = _with_mixed(model, mixed)
    errors = {"sum": error_pct(model, test), "fit": error_pct(fitted, test)}
    chosen = min(errors, key=lambda f: (errors[f], f != "sum"))  # a tie goes to the form with no extra terms
    return chosen, {**entry, **{f: round(e, 2) for f, e in errors.items()}, "chosen": chosen}


def physical(mixed: Sequence[float]) -> bool:
    """A mixed fit whose every work term (new tokens, attention, decode context, decodes) is
    non-negative: more work never makes a step faster. A grid whose decodes and contexts grow
    together lets least squares trade one for the other (say +2.5 ms per context token, -640 ms per
    decode): it fits those points and predicts nonsense for any other ratio of the two."""
    return all(c >= 0 for c in mixed[1:])


def _with_mixed(model: StepModel, mixed: tuple[float, ...]) -> StepModel:
    return StepModel(model.prefill, model.decode_small, model.decode_large, model.decode_threshold, "fit", mixed)


def _error_entry(model: StepModel, train: Sequence[MeasuredStep], test: Sequence[MeasuredStep]) -> dict:
    return {"median_abs_error_pct": round(error_pct(model, test), 2), "n_train": len(train), "n_test": len(test)}


def _refit_all(kinds: dict[str, list[MeasuredStep]], threshold: int, form: str) -> StepModel:
    small, large = decode_split(kinds["decode"], threshold)
    model = StepModel(prefill_coefficients(kinds["prefill"]), small, large, threshold)
    mixed = mixed_coefficients(kinds["mixed"]) if form == "fit" else ()
    return _with_mixed(model, mixed) if mixed and physical(mixed) else model
