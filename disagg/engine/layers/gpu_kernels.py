"""The Triton kernels of the CUDA path, where they run: decode paged attention
(triton_attention.py) and the small fused ones around the GEMMs (triton_fused.py: RMSNorm with
the residual, rotary with the KV write, the gated activations).

EngineConfig.attention_backend picks, as on CPU (cpu_kernels.py): `auto` (Triton's kernels on a
CUDA device where Triton is installed), `torch` (none: every op in torch), `kernel` (Triton's or
an error). Without Triton, or off CUDA, the accessors return None and the layers run their torch
code. Every launcher takes its grid from tensor shapes alone (no value read back from the
device), so a decode step that calls them can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from disagg.engine.layers.cpu_kernels import DecodeKernel, check_backend


def decode_kernel(device: torch.device, backend: str) -> DecodeKernel | None:
    """The Triton decode attention for a CUDA device, or None (backend `torch`, no Triton, not CUDA)."""
    kernels = triton_module("triton_attention", device, backend)
    return None if kernels is None else kernels.paged_decode_attention


def fused_ops(device: torch.device, backend: str) -> ModuleType | None:
    """triton_fused (rms_norm, rotary_kv_write, gated_activation) for a CUDA device, or None."""
    return triton_module("triton_fused", device, backend)


def triton_module(name: str, device: torch.device, backend: str) -> ModuleType | None:
    """disagg.engine.layers.<name> where its kernels should run on `device`, else None."""
    if check_backend(backend) == "torch" or device.type != "cuda":
        return None
    module = _imported(name)
    if module is None and backend == "kernel":
        raise RuntimeError("attention backend `kernel` on CUDA needs Triton, which is not installed")
    return module


@functools.cache
def _imported(name: str) -> ModuleType | None:
    """Cached: an import that failed is not retried at every layer."""
    try:
        return importlib.import_module(f"disagg.engine.layers.{name}")
    except ImportError:  # no Triton here
        return None
