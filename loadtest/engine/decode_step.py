"""The batch-1 decode step: fused decoder layers (EngineConfig.fused_layer) on and off, in one run.

One process holds both engines (the default model, SmolLM2-135M as its GGUF keeps it, Q4_1) and
runs one greedy stream on each in turn, --repeats times, interleaved (the machine is shared and
noisy): per side the median over repeats of each stream's median decode step (each step timed
alone), the fastest step, and tok/s (tokens over the request's wall time). With --profile, one
more stream per side under cProfile, its time split into each C++ kernel, other torch ops, and
Python by where it runs.

    python -m loadtest.engine.decode_step                 # 5 repeats x 128 tokens, 1 thread
    python -m loadtest.engine.decode_step --profile --repeats 9    # as in loadtest/results/decode_step.md
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

from disagg.bench.results import host_line, write_results
from loadtest.engine.throughput import default_gguf

SIDES = {"fused": True, "unfused": False}
# Where cProfile's own time of a function goes: by the file it is in (first match wins).
PYTHON_PLACES = {
    "model (layers, model)": ("disagg/engine/models/", "disagg/engine/layers/", "torch/nn/modules/"),
    "step (runner, sampler)": ("disagg/engine/model_runner", "disagg/engine/sampler"),
    "engine loop (scheduler, outputs)": ("disagg/",),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M GGUF")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="also split one stream's time per side (cProfile)")
    parser.add_argument("--out", default="loadtest/results/decode_step/decode_step.json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    engines = {side: _engine(args, fused) for side, fused in SIDES.items()}
    runs = {side: [] for side in SIDES}
    for _ in range(args.repeats):
        for side, llm in engines.items():
            runs[side].append(_stream(llm, args))
    figures = {side: _medians(r) for side, r in runs.items()}
    figures["step_ratio_unfused_over_fused"] = figures["unfused"]["step_ms"] / figures["fused"]["step_ms"]
    figures["tok_s_ratio_fused_over_unfused"] = figures["fused"]["tok_s"] / figures["unfused"]["tok_s"]
    # Each repeat's two streams ran back to back: their ratio is the least disturbed by the others' load.
    paired = [u["step_ms"] / f["step_ms"] for f, u in zip(runs["fused"], runs["unfused"])]
    figures["paired_step_ratio_median"] = statistics.median(paired)
    figures["fastest_step_ms"] = {side: min(r["fastest_step_ms"] for r in runs[side]) for side in SIDES}
    if args.profile:
        figures["profile"] = {side: _profile(llm, args) for side, llm in engines.items()}
    _print(figures)
    write_results(args.out, {"figures": figures, "runs": runs}, args)
    return 0


def _engine(args, fused: bool):
    from disagg import LLM

    model = args.model or os.path.join(*default_gguf())
    llm = LLM(model=model, num_threads=args.threads, fused_layer=fused)
    _stream(llm, args, output_len=4)  # warm-up: kernels loaded, caches made
    return llm


def _prompt(args) -> dict:
    return {"prompt_token_ids": [100 + i for i in range(args.prompt_len)]}


def _stream(llm, args, output_len: int | None = None) -> dict:
    """One request driven step by step: its decode steps timed one by one (their median is
    less disturbed by a burst of the others' load than the request's mean TPOT)."""
    from disagg import SamplingParams

    n = output_len or args.output_len
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engine = llm.engine
    engine.add_request(
        f"stream-{time.monotonic_ns()}", prompt_token_ids=_prompt(args)["prompt_token_ids"], sampling_params=params
    )
    steps = []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        begun = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - begun)
    wall = time.perf_counter() - started
    decodes = steps[1:]  # the first step computes the prompt
    return {
        "step_ms": 1000 * statistics.median(decodes),
        "fastest_step_ms": 1000 * min(decodes),
        "tok_s": n / wall,
        "ttft_ms": 1000 * steps[0],
    }


def _medians(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def _profile(llm, args) -> dict:
    """Seconds per decode step, by where the time went (cProfile's own time of each function)."""
    profiler = cProfile.Profile()
    profiler.enable()
    _stream(llm, args)
    profiler.disable()
    split: dict[str, float] = {}
    for (path, _, name), (_, _, own, _, _) in pstats.Stats(profiler).stats.items():
        place = _place(path, name)
        split[place] = split.get(place, 0.0) + own
    return {place: 1000 * seconds / args.output_len for place, seconds in sorted(split.items())}


def _place(path: str, name: str) -> str:
    if "disagg_cpu" in name or "mkldnn" in name:  # each kernel apart: "C++: q8_gemv" (the logits)
        return "C++: " + name.rpartition(".")[2].rstrip(">}")
    if path == "~":
        return "other torch ops and builtins"
    for place, parts in PYTHON_PLACES.items():
        if any(part in path for part in parts):
            return f"Python: {place}"
    return "Python: other (torch dispatch, stdlib)"


def _print(figures: dict) -> None:
    print(host_line())
    for side in SIDES:
        f = figures[side]
        print(
            f"{side:8s} decode step {f['step_ms']:6.2f} ms (a stream's fastest: {f['fastest_step_ms']:6.2f})"
            f"  {f['tok_s']:6.1f} tok/s  TTFT {f['ttft_ms']:6.1f} ms"
        )
    print(
        f"unfused / fused step: {figures['step_ratio_unfused_over_fused']:.2f}x;"
        f" fused / unfused tok/s: {figures['tok_s_ratio_fused_over_unfused']:.2f}x;"
        f" median of the paired step ratios {figures['paired_step_ratio_median']:.2f}x;"
        f" fastest steps {figures['fastest_step_ms']['fused']:.2f} / {figures['fastest_step_ms']['unfused']:.2f} ms"
    )
    for side, split in figures.get("profile", {}).items():
        print(f"profile, {side} (ms per step under cProfile):")
        for place, ms in split.items():
            print(f"  {place:40s} {ms:6.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
