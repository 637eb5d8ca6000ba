"""RMSNorm, rotary embedding (with the KV write) and the MLP's gated activation through fused
kernels where they apply: the C++ CPU ops (csrc/fused_ops.cpp) and Triton's on CUDA
(triton_fused.py).

At decode batch sizes each torch version is 3-8 small ops of about 10 us on CPU, a launch each
on a GPU; the fused ones do one pass. On CPU they apply to float32 tensors when the kernel
library is available (cpu_kernels.py); on CUDA to any float dtype where Triton is installed
(gpu_kernels.py). The backend `torch` switches both off, and everything else runs the torch code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disagg.engine.kv_cache import KVCache
from disagg.engine.layers import gpu_kernels
from disagg.engine.layers.cpu_kernels import cpu_ops
from disagg.engine.layers.norm import RMSNorm
from disagg.engine.layers.rotary import apply_rotary

_UNRESOLVED = object()


class _LazyOps:
    """The fused kernels for the device of the first tensor seen (a module's device does not
    change): torch.ops.disagg_cpu on CPU, triton_fused on CUDA, or None for either."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._cpu = self._gpu = _UNRESOLVED

    def get(self, x: torch.Tensor):
        """The C++ ops, for a float32 tensor on CPU."""
        if self._cpu is _UNRESOLVED:
            self._cpu = cpu_ops(x.device, self.backend)
        return self._cpu if x.dtype == torch.float32 else None

    def gpu(self, x: torch.Tensor):
        """triton_fused, on CUDA."""
        if self._gpu is _UNRESOLVED:
            self._gpu = gpu_kernels.fused_ops(x.device, self.backend)
        return self._gpu


class FusedRMSNorm(RMSNorm):
    def __init__(self, hidden_size: int, eps: float = 1e-6, backend: str = "auto", unit_offset: bool = False):
        """`backend`: cpu_kernels.BACKENDS (EngineConfig.attention_backend); `unit_offset`: RMSNorm's."""
        super().__init__(hidden_size, eps, unit_offset)
        self._ops = _LazyOps(backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        gpu = self._ops.gpu(x)
        if gpu is not None:
            return self._triton(gpu, x, residual)
        ops = self._ops.get(x)
        if ops is None or x.dim() != 2 or self.weight.dtype != torch.float32:
            return super().forward(x, residual)
        return ops.rms_norm(x, residual, self.scale(), self.eps)

    def _triton(self, ops, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        contiguous_rows = x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
        if x.dim() not in (2, 3) or not contiguous_rows:
            return super().forward(x, residual)
        return ops.rms_norm(x, residual, self.weight, self.eps, self.unit_offset)


class Rotary:
    """apply_rotary(x, cos, sin) for x [T, heads, D], fused where it applies; on CUDA fused with
    the KV cache write as well (`rotate_and_store`)."""

    def __init__(self, backend: str = "auto") -> None:
        self._ops = _LazyOps(backend)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ops = self._ops.get(x)
        if ops is None or cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
            return apply_rotary(x, cos, sin)
        return ops.rotary(x, cos, sin)

    def rotate_and_store(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        layer: int,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """qk [T, H + KVH, D] (q's heads, then k's) rotated, and the rotated k and v [T, KVH, D]
        written to their cache slots: (q, k). On CUDA one Triton launch, which rotates qk in place."""
        heads = qk.shape[1] - v.shape[1]
        ops = self._ops.gpu(qk)
        if ops is not None and qk.stride(-1) == 1 and v.stride(-1) == 1:
            ops.rotary_kv_write(qk, v, cos, sin, kv_cache.layer(layer), slot_mapping, heads)
            return qk[:, :heads], qk[:, heads:]
        rotated = self(qk, cos, sin)
        k = rotated[:, heads:]
        kv_cache.write(layer, slot_mapping, k, v)
        return rotated[:, :heads], k


class GatedActivation:
    """act(gate) * up of a fused [gate; up] projection's output [T, 2I] -> [T, I]: SiLU (SwiGLU)
    or GELU's tanh approximation (GeGLU); one Triton launch on CUDA."""

    def __init__(self, backend: str = "auto", gelu_tanh: bool = False) -> None:
        self._ops = _LazyOps(backend)
        self.gelu_tanh = gelu_tanh

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        ops = self._ops.gpu(gate_up)
        if ops is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return ops.gated_activation(gate_up, self.gelu_tanh)
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") if self.gelu_tanh else F.silu(gate)) * up
