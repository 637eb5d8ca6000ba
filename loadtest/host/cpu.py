"""Measure this machine's roofline figures for `disagg.planner.hardware`'s "cpu" entry.

The planner's roofline needs a peak GEMM rate and a memory bandwidth per device. For the GPUs
those come from datasheets; for the development machine we measure them, because the vCPU model
changes between sessions and a datasheet for "AMD EPYC" under KVM says nothing useful.

Prints JSON: CPU model and flags of note, float32 and bfloat16 matmul GFLOP/s at 1 and 2 threads
(best of several 2048^3 products, after a warm-up), and large-array copy GB/s (read + write bytes,
arrays far larger than the caches). Best-of, not median: the roofline wants the ceiling, and the
machine is shared.

    .venv/bin/python -m loadtest.host.cpu [--size 2048] [--repeats 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch

from disagg.bench.results import cpu_flags, cpu_model, write_results


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: oneDNN builds its kernel for the shape on first use
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(size: int, dtype: torch.dtype, threads: int, repeats: int) -> float:
    torch.set_num_threads(threads)
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    seconds = best_seconds(lambda: torch.mm(a, b), repeats)
    return 2 * size**3 / seconds / 1e9


def copy_gb_s(num_bytes: int, threads: int, repeats: int) -> float:
    torch.set_num_threads(threads)
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), repeats)
    return 2 * num_bytes / seconds / 1e9  # each byte read once and written once


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--copy-mb", type=int, default=1024)
    parser.add_argument("--json", help="write the figures here too (with the host and commit)")
    args = parser.parse_args(argv)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512f", "avx512_bf16", "amx", "avx2")))
    result = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(), "flags": flags, "torch": torch.__version__}
    for threads in (1, 2):
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            result[f"{label}_gflops_{threads}t"] = round(matmul_gflops(args.size, dtype, threads, args.repeats), 1)
        result[f"copy_gb_s_{threads}t"] = round(copy_gb_s(args.copy_mb * 2**20, threads, args.repeats), 1)
    print(json.dumps(result, indent=1))
    if args.json:
        write_results(args.json, result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
