"""The one results writer of the benchmarks: every figure saved with the host it was measured on
(CPU model and count, the vector instructions it has, memory, accelerator) and the commit that
measured it, since the machine's CPU changes from one day to the next and a figure means
nothing without them.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

# The vector instructions that decide what the CPU kernels (and llama.cpp) can use.
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
REPO = Path(__file__).resolve().parents[2]


def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo names for this CPU (empty where there is none)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def isa_tag(flags: set[str]) -> str:
    """The vector instructions among `flags`, e.g. "avx2-avx512f" ("generic" for none)."""
    return "-".join(f for f in ISA_FLAGS if f in flags) or "generic"


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def commit() -> str:
    """This checkout's commit, "-dirty" when disagg/ or loadtest/ has changes ("unknown" outside git)."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False)
        return done.stdout.strip()

    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = git("rev-parse", "--short", "HEAD")
        if head:
            return head + ("-dirty" if git("status", "--porcelain", "--", "disagg", "loadtest") else "")
    return "unknown"


def host_facts() -> dict:
    """What a figure was measured on."""
    memory_gib = None
    with contextlib.suppress(OSError, ValueError):
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": commit(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "cpu_flags": isa_tag(cpu_flags()),
        "memory_gib": memory_gib,
        "accelerator": _accelerator(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def _accelerator() -> str | None:
    """The CUDA device's name where torch is already loaded and sees one (never loads torch)."""
    torch = sys.modules.get("torch")
    with contextlib.suppress(Exception):
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    return None


def host_line(facts: dict | None = None) -> str:
    """One line to print beside figures: "host: <cpu>, N CPUs, <flags>; commit <sha>"."""
    facts = facts or host_facts()
    gpu = f", {facts['accelerator']}" if facts.get("accelerator") else ""
    return f"host: {facts['cpu']}, {facts['cpus']} CPUs, {facts['cpu_flags']}{gpu}; commit {facts['commit']}"


def write_results(path: str | Path, figures: dict, args=None) -> Path:
    """`figures` as JSON at `path` (its folders made), with "host" (host_facts) and, given the
    script's parsed `args`, "args" beside them; prints where it went."""
    data = dict(figures)
    data.setdefault("host", host_facts())
    if args is not None:
        data.setdefault("args", {k: _plain(v) for k, v in vars(args).items()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def _plain(value):
    return str(value) if isinstance(value, Path) else value
