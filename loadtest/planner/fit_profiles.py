"""Fit what DistServe's published profiles lack, on the given measured runs, and print the errors.

The fitted values go into disagg/placement/published_profiles.py (FITTED).

    .venv/bin/python -m loadtest.planner.fit_profiles [--data ../shared/data/distserve] [--smoke]

For each engine (DistServe, vLLM 0.2), on its runs in the data directory, with everything else as
`disagg.planner.traced_systems` says (settings from DistServe's launch script, memory rules and
decode admission from their code), starting from the forward-pass profiles:
1. a first guess of `frontend_ms` and `prefill_scale` from the TTFT of isolated requests (none
   arrived in the 1 s before: no prompt queued ahead), the simulator's TTFT of the same requests
   against the measured one: the grid point with the least median relative error;
2. then all four values against every run's attainment and TTFT and TPOT p50 and p90, each
   error in units of its target (3 points of attainment, 10% of a percentile): the least mean,
   by a pattern search from the first guess (and the decode loop's time from the fitted values
   in published_profiles.py).
Prints the fitted values (FITTED in disagg/placement/published_profiles.py) and each run's errors
with them.
Runs kept aside (other rates and lengths) check what was fitted here.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import sys
from pathlib import Path

from disagg.bench.results import host_line
from disagg.placement.profile import as_served, load_profile
from disagg.placement.published_profiles import FITTED, ServedStep
from disagg.planner.deployment import trace_deployment
from disagg.planner.simulator import percentile, slo_attainment
from disagg.planner.workload import load_trace
from disagg.slo import met
from loadtest.planner import DISTSERVE_DATA

ISOLATED_GAP_S = 1.0
FRONTEND_MS = [float(v) for v in range(0, 21)]
PREFILL_SCALES = [round(0.7 + 0.05 * i, 2) for i in range(9)]  # 0.7 .. 1.1
START_STEPS = {"frontend_ms": 2.0, "prefill_scale": 0.05, "decode_per_step_ms": 1.0, "decode_per_request_ms": 0.04}
MIN_STEPS = {"frontend_ms": 0.5, "prefill_scale": 0.0125, "decode_per_step_ms": 0.25, "decode_per_request_ms": 0.01}


@dataclasses.dataclass(frozen=True)
class Effort:
    """How hard the fit searches: runs per engine, the first guess's grid, the pattern search's rounds."""

    max_runs: int | None = None
    frontend_ms: tuple[float, ...] = tuple(FRONTEND_MS)
    prefill_scales: tuple[float, ...] = tuple(PREFILL_SCALES)
    max_rounds: int | None = None


FULL = Effort()
SMOKE = Effort(max_runs=1, frontend_ms=(0.0, 20.0), prefill_scales=(0.8, 1.0), max_rounds=1)  # runs, no figures


def runs_of(data: Path, engine: str) -> list[tuple[Path, object, object]]:
    out = []
    for path in sorted(data.glob(f"{engine}-*.json")):
        trace = load_trace(str(path))
        profile = load_profile(str(data / f"profiler-a100-80g.{engine}.json"), model=trace.model, served=False)
        out.append((path, trace, profile))
    return out


def simulate(trace, profile, served: ServedStep):
    """The trace replayed with its forward-pass `profile` served as `served` says."""
    return trace_deployment(trace.config, trace.model, as_served(profile, served)).simulator().run(trace.requests)


def fit_prefill(runs, served, effort: Effort = FULL):
    """(frontend_ms, prefill_scale) with the least median |simulated - measured| / measured TTFT
    over isolated requests."""
    best = None
    for scale in effort.prefill_scales:
        scaled = dataclasses.replace(served, frontend_ms=0.0, prefill_scale=scale)
        pairs = []  # (simulated without frontend, measured) of isolated requests
        for _, trace, profile in runs:
            records = simulate(trace, profile, scaled)
            previous = None
            for request, record, measured in zip(trace.requests, records, trace.measured):
                if previous is None or request.arrival_s - previous > ISOLATED_GAP_S:
                    pairs.append((record.ttft_s * 1e3, measured["ttft_ms"]))
                previous = request.arrival_s
        for frontend in effort.frontend_ms:
            error = statistics.median(abs(s + frontend - m) / m for s, m in pairs)
            if best is None or error < best[0]:
                best = (error, frontend, scale, len(pairs))
    return best


def fit_jointly(runs, served, effort: Effort = FULL):
    """Pattern search on the mean target error of every run's figures: each value up and down by
    its step, the best move taken, the steps halved when none helps; (error, served)."""
    steps = dict(START_STEPS)
    best = (mean_error(runs, served), served)
    rounds = itertools.count(1)
    while any(steps[k] >= MIN_STEPS[k] for k in steps) and next(rounds) <= (effort.max_rounds or math.inf):
        moves = [
            dataclasses.replace(best[1], **{k: round(getattr(best[1], k) + sign * step, 4)})
            for k, step in steps.items()
            if step >= MIN_STEPS[k]
            for sign in (1, -1)
            if getattr(best[1], k) + sign * step >= 0
        ]
        tried = min((mean_error(runs, m), m) for m in moves)
        if tried[0] < best[0] - 1e-9:
            best = tried
            print(f"   {best[0]:.3f} {best[1]}", flush=True)
        else:
            steps = {k: v / 2 for k, v in steps.items()}
    return best


def mean_error(runs, served) -> float:
    return statistics.mean(
        e for _, trace, profile in runs for e in target_errors(trace, simulate(trace, profile, served))
    )


def target_errors(trace, records) -> list[float]:
    """|attainment error| / 3 points and |percentile error| / 10% for TTFT and TPOT p50 and p90."""
    slo = trace.slo
    measured_met = [met(slo, m["ttft_ms"], m["tpot_ms"]) for m in trace.measured]
    errors = [abs(slo_attainment(records, slo) - 100 * sum(measured_met) / len(measured_met)) / 3]
    for key, attr in (("ttft_ms", "ttft_s"), ("tpot_ms", "tpot_s")):
        simulated = [getattr(r, attr) * 1e3 for r in records]
        measured = [m[key] for m in trace.measured]
        for q in (50, 90):
            s, m = percentile(simulated, q), percentile(measured, q)
            errors.append(abs(s - m) / m / 0.10)
    return errors


def report(runs, served) -> None:
    for path, trace, profile in runs:
        records = simulate(trace, profile, served)
        slo = trace.slo
        simulated_att = slo_attainment(records, slo)
        measured_met = [met(slo, m["ttft_ms"], m["tpot_ms"]) for m in trace.measured]
        cells = [f"attainment {simulated_att:5.1f} / {100 * sum(measured_met) / len(measured_met):5.1f}"]
        for key, attr in (("ttft_ms", "ttft_s"), ("tpot_ms", "tpot_s")):
            simulated = [getattr(r, attr) * 1e3 for r in records]
            measured = [m[key] for m in trace.measured]
            for q in (50, 90):
                s, m = percentile(simulated, q), percentile(measured, q)
                cells.append(f"{key[:4]} p{q} {(s - m) / m:+4.0%}")
        print(f"   {path.stem:24} " + "  ".join(cells))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DISTSERVE_DATA))
    parser.add_argument("--smoke", action="store_true", help="one run per engine, a coarse search: runs, no figures")
    args = parser.parse_args(argv)
    print(host_line(), flush=True)
    effort = SMOKE if args.smoke else FULL
    for name, served in FITTED.items():
        runs = runs_of(Path(args.data), name)[: effort.max_runs]
        if not runs:
            continue
        error, frontend, scale, isolated = fit_prefill(runs, served, effort)
        served = dataclasses.replace(served, frontend_ms=frontend, prefill_scale=scale)  # the decode terms as fitted
        print(f"{name}: first guess frontend_ms={frontend} prefill_scale={scale} ({isolated} isolated requests, "
              f"median TTFT error {error:.1%})", flush=True)  # fmt: skip
        error, served = fit_jointly(runs, served, effort)
        fitted = {
            k: getattr(served, k)
            for k in ("frontend_ms", "prefill_scale", "decode_per_step_ms", "decode_per_request_ms")
        }
        print(f"{name}: {fitted} (mean error {error:.2f} targets)")
        report(runs, served)
    return 0


if __name__ == "__main__":
    sys.exit(main())
