"""`disagg profile`: its arguments, the request they make, and the table of errors it prints."""

from __future__ import annotations

import argparse
import os
import sys

from disagg.config import DEFAULT_MODEL, EngineConfig
from disagg.placement.profile import Profile


def add_command(sub) -> None:
    p = sub.add_parser("profile", help="measure the engine's step times on this machine and fit the latency model")
    add_arguments(p)
    p.set_defaults(func=main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file, HF directory, random:<shape> or the default")
    parser.add_argument("--tp-pp", default=None, help="shapes as TPxPP, e.g. 1x1,2x1,1x2 (default: all that fit)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    parser.add_argument("--max-prompt-len", type=int, default=None, help="longest prompt (1024; quick: 128)")
    parser.add_argument("--max-batch", type=int, default=None, help="largest decode batch (32; quick: 8)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per grid point (3; quick: 1)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--quick", action="store_true", help="a small grid: a smoke test, not a profile to plan with")
    parser.add_argument("-o", "--output", required=True, help="profile file to write (JSON)")


def main(args: argparse.Namespace) -> int:
    # torch and the engine load here, not when `disagg` builds its parser for another command.
    from disagg.profiling.profiler import run_profile

    try:
        req = profile_request(args)
    except ValueError as exc:
        print(f"disagg profile: {exc}", file=sys.stderr)
        return 2
    profile = run_profile(req, log=lambda line: print(line, file=sys.stderr))
    profile.save(args.output)
    print(error_table(profile))
    print(f"wrote {args.output} ({profile.fit['seconds']} s)")
    return 0


def profile_request(args: argparse.Namespace):
    """The ProfileRequest of these arguments; ValueError for what cannot be measured here."""
    from disagg.profiling.device import check_device, default_device
    from disagg.profiling.profiler import ProfileRequest

    if args.threads < 1:
        raise ValueError("--threads must be >= 1")
    device = args.device or default_device()
    shapes = _shapes(args, device)
    check_device(device, shapes)
    quick = args.quick
    return ProfileRequest(
        model=args.model,
        shapes=tuple(shapes),
        threads=args.threads,
        max_prompt_len=args.max_prompt_len or (128 if quick else 1024),
        max_batch=args.max_batch or (8 if quick else 32),
        repeats=args.repeats or (1 if quick else 3),
        quick=quick,
        dtype=args.dtype,
        device=device,
    )


def _shapes(args: argparse.Namespace, device: str) -> list[tuple[int, int]]:
    """--tp-pp's; by default every shape that fits the cores, or on a GPU the one it holds."""
    from disagg.engine.loader import load_model_source
    from disagg.profiling.profiler import default_shapes

    if args.tp_pp:
        return parse_shapes(args.tp_pp)
    if device != "cpu":
        return [(1, 1)]
    source = load_model_source(args.model, cache_dir=EngineConfig().cache_dir)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return default_shapes(source.config, cores)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        tp, _, pp = part.strip().lower().partition("x")
        if not (tp.isdigit() and pp.isdigit()) or int(tp) < 1 or int(pp) < 1:
            raise ValueError(f"--tp-pp: {part!r} is not TPxPP like 2x1")
        shapes.append((int(tp), int(pp)))
    return shapes


def error_table(profile: Profile) -> str:
    """Held-out median absolute errors, one row per shape."""
    lines = [f"{'shape':<8} {'prefill %':>9} {'decode %':>9} {'mixed sum %':>11} {'mixed fit %':>11}  chosen"]
    for key, entry in profile.fit["shapes"].items():
        mixed = entry["mixed"]
        lines.append(
            f"{key:<8} {entry['prefill']['median_abs_error_pct']:>9.1f} {entry['decode']['median_abs_error_pct']:>9.1f}"
            f" {_pct(mixed.get('sum')):>11} {_pct(mixed.get('fit')):>11}  {mixed['chosen']}"
        )
    return "\n".join(lines)


def _pct(value: float | str | None) -> str:
    """A figure, or what stands in its place ("rejected": a fit whose terms were not all >= 0)."""
    if value is None:
        return "-"
    return value if isinstance(value, str) else f"{value:.1f}"


if __name__ == "__main__":  # `python -m disagg.profiling.cli`: without the rest of the CLI (a bare GPU machine)
    _parser = argparse.ArgumentParser(prog="disagg profile", description="measure step times and fit the latency model")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
