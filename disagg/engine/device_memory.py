"""How much memory a worker may take on its device, asked of the device itself: on a GPU what it
has free, at most the worker's share of it (`gpu_memory_utilization`: workers sharing one GPU);
on a CPU what the host has available, at most what the process's cgroup still allows."""

from __future__ import annotations

import os

import torch

from disagg.config import GiB

MEMINFO = "/proc/meminfo"
CGROUP_DIR = "/sys/fs/cgroup"  # cgroup v2, as a container sees its own


def available_memory(device: torch.device, utilization: float | None) -> tuple[float, str]:
    """(bytes this worker may use, what they are, for a message)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return gpu_budget(free, total, utilization), _describe_gpu(device, free, total, utilization)
    return host_available_bytes(), "this host's available memory"


def gpu_budget(free: float, total: float, utilization: float | None) -> float:
    """What the GPU has free, and at most `utilization` of all its memory (None: no cap): two
    workers at 0.5 each starting at once must not both count on all of it."""
    return free if utilization is None else min(free, utilization * total)


def _describe_gpu(device: torch.device, free: float, total: float, utilization: float | None) -> str:
    share = "" if utilization is None else f", this worker's share {utilization:g} of it (gpu_memory_utilization)"
    return f"{device} ({free / GiB:.2f} GiB free of {total / GiB:.2f} GiB{share})"


def host_available_bytes() -> float:
    """MemAvailable, at most the cgroup's limit less its usage."""
    available = _meminfo_available()
    room = _cgroup_room()
    return available if room is None else min(available, room)


def _meminfo_available() -> float:
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # free pages: a lower figure


def _cgroup_room() -> float | None:
    try:
        with open(os.path.join(CGROUP_DIR, "memory.max")) as f:
            limit = f.read().strip()
        with open(os.path.join(CGROUP_DIR, "memory.current")) as f:
            current = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - current)
