"""What bounding oneDNN's per-shape caches costs a CPU prefill worker, and what it saves.

oneDNN builds GEMM kernels for each input shape it meets, and keeps them in two caches (its
primitive cache, ONEDNN_PRIMITIVE_CACHE_CAPACITY, and ideep's, LRU_CACHE_CAPACITY; 1024 entries
each by default). A prefill step's row count is its token count, so a worker that meets many
prompt lengths fills both, and each entry holds about a megabyte. The engine bounds them
(disagg/engine/layers/cpu_gemm.py); this benchmark measures the bound against oneDNN's default.

Each capacity runs in a fresh process (the caches read their size once): the same prompts of
random lengths, prefill only (one output token), one at a time, after a warm-up. Prints, per
capacity, the RSS the workload added, the mean and p50 prefill time, and the first-time and
repeat prefill times of lengths met more than once; ratios against oneDNN's default.

    .venv/bin/python -m loadtest.engine.onednn_cache [--prompts 300] [--max-len 512] [--capacities default,256,128]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from disagg.bench.results import host_line, write_results

ONEDNN_DEFAULT = "1024"  # both caches' size when nothing sets them


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def workload(prompts: int, max_len: int, seed: int) -> list[list[int]]:
    """Lengths uniform over 8..max_len (most met once, some twice), random token ids."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(rng.randint(8, max_len))] for _ in range(prompts)]


def child(capacity: str, prompts: int, max_len: int, seed: int) -> None:
    """One capacity in this process: prints a JSON line of its figures."""
    import torch

    from disagg.config import EngineConfig
    from disagg.engine.engine import LLMEngine
    from disagg.engine.layers.cpu_gemm import CACHE_CAPACITY_ENV

    for name in CACHE_CAPACITY_ENV:  # before the engine, which sets its own bound where unset
        os.environ[name] = ONEDNN_DEFAULT if capacity == "default" else capacity
    torch.set_num_threads(1)
    from disagg.request import SamplingParams

    engine = LLMEngine(EngineConfig(num_threads=1, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    run = 0

    def prefill(ids: list[int]) -> float:
        nonlocal run
        run += 1
        start = time.perf_counter()
        engine.add_request(str(run), prompt_token_ids=ids, sampling_params=params)
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    for ids in workload(4, 32, seed + 1):
        prefill(ids)
    before = rss_mb()
    seen: set[int] = set()
    times, first, repeat = [], [], []
    for ids in workload(prompts, max_len, seed):
        t = prefill(ids)
        times.append(t)
        (repeat if len(ids) in seen else first).append((len(ids), t))
        seen.add(len(ids))
    repeated = {n for n, _ in repeat}
    print(
        json.dumps(
            {
                "capacity": capacity,
                "rss_added_mb": rss_mb() - before,
                "mean_ms": statistics.mean(times) * 1e3,
                "p50_ms": statistics.median(times) * 1e3,
                # the same lengths' first and later prefills: what a rebuilt kernel costs
                "first_ms": statistics.mean(t for n, t in first if n in repeated) * 1e3 if repeated else None,
                "repeat_ms": statistics.mean(t for _, t in repeat) * 1e3 if repeat else None,
                "distinct_lengths": len(seen),
            }
        ),
        flush=True,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--max-len", type=int, default=512, help="the default per-step token budget")
    parser.add_argument("--capacities", default="default,256,128", help="'default' is oneDNN's own (1024 each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.prompts, args.max_len, args.seed)
        return 0
    print(host_line(), flush=True)
    results = []
    for capacity in args.capacities.split(","):
        command = [
            sys.executable,
            "-m",
            __spec__.name,
            "--child",
            capacity,
            "--prompts",
            str(args.prompts),
            "--max-len",
            str(args.max_len),
            "--seed",
            str(args.seed),
        ]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    base = next((r for r in results if r["capacity"] == "default"), results[0])
    print(
        f"\n{args.prompts} prefills of 8-{args.max_len} tokens ({base['distinct_lengths']} distinct lengths), one at a time, one thread"
    )
    print(
        f"{'capacity':>10} {'RSS added':>10} {'mean':>9} {'p50':>9} {'first':>9} {'repeat':>9} {'mean ratio':>11} {'RSS ratio':>10}   (MB, ms)"
    )
    for r in results:
        print(
            f"{r['capacity']:>10} {r['rss_added_mb']:10.0f} {r['mean_ms']:9.1f} {r['p50_ms']:9.1f} {r['first_ms'] or 0:9.1f} {r['repeat_ms'] or 0:9.1f} {r['mean_ms'] / base['mean_ms']:11.3f} {r['rss_added_mb'] / max(base['rss_added_mb'], 1):10.2f}"
        )
    if args.json:
        write_results(args.json, {"capacities": results}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
