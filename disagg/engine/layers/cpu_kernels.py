"""The C++ CPU kernels (csrc/): decode paged attention, the fused norm and rotary ops, and the
KV block copy of a transfer between workers on one host.

One shared library, built on first use and registered as torch.ops.disagg_cpu.*. It goes into a
cache directory (DISAGG_KERNEL_CACHE, else ~/.cache/disagg/kernels) under a name keyed by the
sources, the flags, the torch version and the CPU's features (the code is built for the CPU it
runs on), so later processes only load it. Without a compiler, or when the build fails, the
accessors return None after one warning and the model keeps its torch code.

EngineConfig.attention_backend (default: DISAGG_ATTENTION_BACKEND) picks: `auto` (the kernels on
CPU when they build), `torch` (none of them: attention, norm and rotary all in torch, and the
transfer's block copy too), `kernel` (the kernels or an error).

    python -m disagg.engine.layers.cpu_kernels --build    # pre-build it (`make setup` does)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from disagg.config import ATTENTION_BACKENDS, env

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name("csrc") / name
    for name in ("paged_attention.cpp", "fused_ops.cpp", "block_copy.cpp", "quantized_gemv.cpp", "decoder_layer.cpp")
]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]  # resolves to the libgomp torch already loaded (same soname): one thread pool
BACKENDS = ATTENTION_BACKENDS  # auto, torch, kernel

# (q, kv_layer, block_tables, context_lens, scale, window) -> out; window 0: no sliding window.
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor]


class KernelUnavailable(RuntimeError):
    pass


def check_backend(choice: str) -> str:
    if choice not in BACKENDS:
        raise ValueError(f"attention backend {choice!r}: expected one of {', '.join(BACKENDS)}")
    return choice


def decode_kernel(device: torch.device, backend: str) -> DecodeKernel | None:
    """The kernel's entry point for this device, or None where attention should use torch.

    (q [B, H, D], kv_layer [2, KVH, blocks, bs, D], block_tables [B, n] int32, context_lens [B]
    int32, scale, window) -> [B, H, D] in q's dtype (the kernel computes in float32). `window` W > 0:
    each decode attends to its last W positions only (a sliding-window layer); 0: to all."""
    ops = cpu_ops(device, backend)
    if ops is None:
        return None
    kernel = ops.decode_attention

    def attend(q: torch.Tensor, *rest) -> torch.Tensor:
        if q.dtype == torch.float32:  # no conversions (two calls into torch a layer, at every step)
            return kernel(q, *rest)
        return kernel(q.float(), *rest).to(q.dtype)

    return attend


def cpu_ops(device: torch.device, backend: str):
    """torch.ops.disagg_cpu (decode_attention, rms_norm, rotary, copy_blocks), or None where
    torch code should run (`backend`: one of BACKENDS)."""
    choice = check_backend(backend)
    if choice == "torch" or device.type != "cpu":
        return None
    loaded = _load()
    if not loaded and choice == "kernel":
        raise KernelUnavailable("attention backend `kernel` but the CPU kernels did not build (see the warning above)")
    return torch.ops.disagg_cpu if loaded else None


@functools.cache
def _load() -> bool:
    """Loads (building first if needed) the library; False (one warning) when it cannot be built.
    Cached: a process registers the ops once."""
    try:
        path = library_path()
        try:
            torch.ops.load_library(str(path))
        except OSError:  # not built yet, or another process is still writing it
            _build(path)  # waits for a concurrent build (torch's file lock), then loads it
        return True
    except Exception as exc:  # any compiler/toolchain failure: the torch path still works
        logger.warning("CPU kernels unavailable, attention, norm and rotary use torch: %s", _first_line(exc))
        return False


def library_path() -> Path:
    name = module_name()
    return cache_dir() / name / f"{name}.so"


def module_name() -> str:
    key = hashlib.sha256()
    for part in (
        *(source.read_bytes() for source in SOURCES),
        " ".join(CFLAGS + LDFLAGS).encode(),
        torch.__version__.encode(),
        sys.version.encode(),
        _cpu_signature().encode(),
    ):
        key.update(part)
    return f"disagg_cpu_kernels_{key.hexdigest()[:16]}"


def cache_dir() -> Path:
    configured = env("DISAGG_KERNEL_CACHE")
    if configured:
        return Path(configured).expanduser()
    base = env("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "disagg" / "kernels"


def _build(path: Path) -> None:
    from torch.utils import cpp_extension  # slow to import: only when building

    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # torch's build locks the directory, so concurrent first uses build once. (It extends the
    # flag lists in place, hence the copies: they are part of the cache key.)
    cpp_extension.load(
        path.stem,
        sources=[str(source) for source in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(path.parent),
        is_python_module=False,  # a plain library registering torch.ops.disagg_cpu.*
        verbose=False,
    )
    logger.info("built the CPU kernels in %.1f s: %s", time.perf_counter() - started, path)


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build (or check) the C++ CPU kernels.")
    parser.add_argument("--build", action="store_true", help="build it now if it is not cached")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.build:
        print(library_path(), "(cached)" if library_path().exists() else "(not built)")
        return 0
    loaded = _load()
    print(f"CPU kernels: {library_path() if loaded else 'NOT available (torch fallback)'}")
    return 0 if loaded else 1


if __name__ == "__main__":
    sys.exit(main())
