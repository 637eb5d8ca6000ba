"""The planner's roofline for a GPU, calibrated against a profile `disagg profile` measured on it
(issue 41): the datasheet roofline's error, the calibrated roofline's error on the points it was
fitted on, and on held-out points between and beyond them, all within the measured range
(the measured profile's own fit is the reference, so nothing is extrapolated).

    python -m loadtest.planner.roofline loadtest/results/gpu-h100/llama3-8b-h100-tp1.json \\
        --model llama3-8b --hardware h100-sxm
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from disagg.bench.results import write_results
from disagg.placement.profile import load_profile
from disagg.planner.roofline import calibrate, compare, roofline_profile


def grids(max_prompt: int, max_batch: int, max_context: int) -> tuple[dict, dict]:
    """(fit grid, held-out grid) of prefill prompts and (decode batch, context) points in range."""
    fit_prefill = [(n,) for n in (64, 128, 256, 512, 1024, 2048, 4096) if n <= max_prompt]
    fit_prefill += [(max_prompt // 8,) * 4]
    held_prefill = [(n,) for n in (48, 200, 700, 1500, 3000) if n <= max_prompt] + [(max_prompt // 16,) * 3]
    fit_batches = [b for b in (1, 4, 16, 32, 64, 128) if b <= max_batch]
    held_batches = [b for b in (2, 8, 24, 48, 96) if b <= max_batch]
    fit_contexts = [c for c in (128, 512, 1024, 2048) if c <= max_context]
    held_contexts = [c for c in (256, 768, 1536) if c <= max_context]
    fit = {"prefill": fit_prefill, "decode": [(b, c) for b in fit_batches for c in fit_contexts]}
    held = {"prefill": held_prefill, "decode": [(b, c) for b in held_batches for c in held_contexts]}
    return fit, held


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", help="a profile written by disagg profile on the GPU")
    p.add_argument("--model", required=True, help="the planner's name of the model (e.g. llama3-8b)")
    p.add_argument("--hardware", required=True, help="the planner's name of the GPU (e.g. h100-sxm)")
    p.add_argument("--out", help="write the calibrated efficiency and the errors as JSON here")
    args = p.parse_args(argv)
    measured = load_profile(args.profile, served=False)
    fit = measured.fit
    fit, held = grids(fit["max_prompt_len"], fit["max_batch"], fit["max_prompt_len"])
    shapes = measured.shapes
    datasheet = roofline_profile(args.model, args.hardware, shapes)
    efficiency = calibrate(args.model, args.hardware, measured, **fit)
    calibrated = roofline_profile(args.model, args.hardware, shapes, efficiency=efficiency)
    report = {
        "efficiency": asdict(efficiency),
        "datasheet_roofline_on_fit_points": _pct(compare(datasheet, measured, **fit)),
        "calibrated_on_fit_points": _pct(compare(calibrated, measured, **fit)),
        "calibrated_on_held_out_points": _pct(compare(calibrated, measured, **held)),
        "fit_points": fit,
        "held_out_points": held,
    }
    print(f"measured: {args.profile} ({measured.hardware}); roofline: {args.model} on {args.hardware}")
    print("efficiency fitted: " + ", ".join(f"{k} {v:.3g}" for k, v in report["efficiency"].items()))
    for key in ("datasheet_roofline_on_fit_points", "calibrated_on_fit_points", "calibrated_on_held_out_points"):
        for shape, errors in report[key].items():
            print(f"{key:34s} {shape}: median |error| {errors['median']:.1f}%, max {errors['max']:.1f}%")
    if args.out:
        write_results(args.out, report, args)
    return 0


def _pct(report: dict) -> dict:
    return {f"tp{tp}-pp{pp}": {k: 100 * v for k, v in errors.items()} for (tp, pp), errors in report.items()}


if __name__ == "__main__":
    sys.exit(main())
