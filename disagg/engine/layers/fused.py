"""RMSNorm and rotary embedding through the fused C++ CPU ops (csrc/fused_ops.cpp) where they apply.

At decode batch sizes each torch version is 5-8 small ops of about 10 us; the fused ops do one
pass. They apply on CPU to float32 tensors when the kernel library is available (see
cpu_kernels.py, and the backend `torch` that switches them off); everything else runs the torch code.
"""

from __future__ import annotations

import torch

from disagg.engine.layers.norm import RMSNorm
from disagg.engine.layers.cpu_kernels import cpu_ops
from disagg.engine.layers.rotary import apply_rotary

_UNRESOLVED = object()


class _LazyOps:
    """The C++ ops for the device of the first tensor seen (a module's device does not change)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._ops = _UNRESOLVED

    def get(self, x: torch.Tensor):
        if self._ops is _UNRESOLVED:
            self._ops = cpu_ops(x.device, self.backend)
        return self._ops if x.dtype == torch.float32 else None


class FusedRMSNorm(RMSNorm):
    def __init__(self, hidden_size: int, eps: float = 1e-6, backend: str = "auto", unit_offset: bool = False):
        """`backend`: cpu_kernels.BACKENDS (EngineConfig.attention_backend); `unit_offset`: RMSNorm's."""
        super().__init__(hidden_size, eps, unit_offset)
        self._ops = _LazyOps(backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self._ops.get(x)
        if ops is None or x.dim() != 2 or self.weight.dtype != torch.float32:
            return super().forward(x, residual)
        return ops.rms_norm(x, residual, self.scale(), self.eps)


class Rotary:
    """apply_rotary(x, cos, sin) for x [T, heads, D], fused where it applies."""

    def __init__(self, backend: str = "auto") -> None:
        self._ops = _LazyOps(backend)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ops = self._ops.get(x)
        if ops is None or cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
            return apply_rotary(x, cos, sin)
        return ops.rotary(x, cos, sin)
