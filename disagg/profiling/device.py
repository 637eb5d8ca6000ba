"""Where `disagg profile` runs: the device, the name its profile gives the hardware, and a clock
that reads the time only once the device has finished the work queued on it."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import torch


def default_device() -> str:
    """The GPU when there is one, as `disagg serve` would use it; else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str, shapes: list[tuple[int, int]]) -> None:
    """ValueError for a device this machine lacks, or a shape the profiler cannot run on it."""
    if device == "cpu":
        return
    if not (device == "cuda" or re.fullmatch(r"cuda:\d+", device)):
        raise ValueError(f"--device: {device!r} is not cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError("--device: CUDA is not available here")
    # The ranks of a shape run as threads of one process; on a GPU each would need its own device
    # and NCCL communicators between threads, which the profiler does not set up.
    several = [f"{tp}x{pp}" for tp, pp in shapes if tp * pp > 1]
    if several:
        raise ValueError(f"--tp-pp: on CUDA the profiler measures 1x1 only, not {', '.join(several)}")


def hardware_name(device: str, threads: int) -> str:
    """What the profile says it measured: `cpu-2t` (the CPU at 2 threads per rank, as the planner's
    hardware names it), or the GPU's own name in lower case, e.g. `nvidia-h100-80gb-hbm3`."""
    if device == "cpu":
        return f"cpu-{threads}t"
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(torch.device(device)).lower()).strip("-")


def device_clock(device: torch.device) -> Callable[[], float]:
    """time.perf_counter, after waiting for the device: CUDA kernels run asynchronously, so a
    clock read without synchronizing would time their launch, not their work."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock
