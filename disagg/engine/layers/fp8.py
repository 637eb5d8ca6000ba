"""FP8 weights on a GPU with FP8 tensor cores (Hopper, Ada): EngineConfig.weights = "fp8".

Each GEMM's weight is kept as float8_e4m3fn with one float32 scale per output channel (its
largest magnitude over 448, e4m3's largest finite value), quantized at load from the bf16 or
fp32 checkpoint: half a bf16 weight's bytes, which a decode step reads once. A step's rows are
quantized likewise, one scale per token (dynamic), and multiplied by `torch._scaled_mm`, which
applies both scales to its float32 sums and rounds once to the model's dtype:

    y[t, o] = sx[t] * sw[o] * sum_i qx[t, i] * qw[o, i]

Where `_scaled_mm`'s row-wise scaling does not apply (no FP8 tensor cores, a dimension not a
multiple of 16, a model dtype other than bfloat16), the weight is multiplied dequantized in the
model's dtype instead (the same weights, activations unquantized), and the engine says so once
(`describe`). The vocabulary projection, the embedding and the norms stay in the model's dtype
(as vLLM keeps them), and so do a mixture of experts' experts (layers/experts.py).

The model is built and loaded in bf16, then its GEMMs converted and the bf16 copies freed
before the KV cache is allocated: loading needs the bf16 weights' memory for a moment, though
the memory fit (memory_fit.py) counts a byte a weight.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALED_MM_ALIGN = 16  # _scaled_mm's inner and output dimensions are multiples of this
SCALED_MM_CAPABILITY = (8, 9)  # Ada and later: FP8 tensor cores
# A row or channel of zeros gets this scale, not 0 (x / 0 would make NaN of its zeros)
_MIN_SCALE = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q [R, C] float8_e4m3fn, scales [R, 1] float32) with x ~ q * scales: one
    scale per row, its largest magnitude mapped to FP8_MAX."""
    xf = x.float()
    scales = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """quantize_rows's inverse (up to its rounding): q * scales in `dtype`."""
    return (q.float() * scales).to(dtype)


def scaled_mm_unavailable(weight: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why a weight [out, in] on its device cannot go through _scaled_mm with row-wise scales
    for activations of `dtype`, or None where it can."""
    if weight.device.type != "cuda":
        return f"{weight.device.type} has no FP8 GEMM"
    capability = torch.cuda.get_device_capability(weight.device)
    if capability < SCALED_MM_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} has no FP8 tensor cores (8.9 and later)"
    if dtype != torch.bfloat16:
        return f"row-wise scaled FP8 GEMMs give bfloat16, the model's dtype is {dtype}"
    if weight.shape[0] % SCALED_MM_ALIGN or weight.shape[1] % SCALED_MM_ALIGN:
        return f"a weight of shape {tuple(weight.shape)} is not in multiples of {SCALED_MM_ALIGN}"
    return _scaled_mm_fails(weight.device)


@functools.cache
def _scaled_mm_fails(device: torch.device) -> str | None:
    """What a small row-wise scaled product raises on `device` (a torch build or GPU without
    that kernel), or None: tried once per device, rather than failing at a model's first step."""
    ones = torch.ones(SCALED_MM_ALIGN, SCALED_MM_ALIGN, device=device)
    q, scales = quantize_rows(ones)
    try:
        torch._scaled_mm(q, q.t(), scale_a=scales, scale_b=scales.view(1, -1), out_dtype=torch.bfloat16)
    except RuntimeError as exc:
        return f"torch._scaled_mm with row-wise scales fails here: {str(exc).splitlines()[0]}"
    return None


class Fp8Weight:
    """A GEMM's weight as FP8 with per-output-channel scales; `linear` as PackedWeight.linear."""

    def __init__(self, weight: torch.Tensor, use_scaled_mm: bool | None = None) -> None:
        """`weight` [out, in] (any float dtype); `use_scaled_mm`: None to decide by
        scaled_mm_unavailable (tests force either path)."""
        self.dtype = weight.dtype
        self.shape = tuple(weight.shape)
        self.q, scales = quantize_rows(weight)
        self.scales = scales.view(1, -1).contiguous()  # [1, out]: _scaled_mm's scale_b
        self.fallback_reason = scaled_mm_unavailable(weight, self.dtype) if use_scaled_mm is None else None
        self.use_scaled_mm = self.fallback_reason is None if use_scaled_mm is None else use_scaled_mm

    def linear(
        self, x: torch.Tensor, _dense=None, bias: torch.Tensor | None = None, decode_rows: int | None = None
    ) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype. `_dense` and `decode_rows` are ignored (every
        row takes the same path: an FP8 product is the same whatever the batch)."""
        rows = x.reshape(-1, self.shape[1])
        out = self._scaled_product(rows) if self.use_scaled_mm else self._dequantized_product(rows)
        out = out.view(*x.shape[:-1], self.shape[0])
        return out if bias is None else out + bias

    def _scaled_product(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 0:
            return rows.new_empty(0, self.shape[0])
        q, scales = quantize_rows(rows)
        # q.t(): the [in, out] column-major operand _scaled_mm wants, with no copy
        return torch._scaled_mm(q, self.q.t(), scale_a=scales, scale_b=self.scales, out_dtype=rows.dtype)

    def _dequantized_product(self, rows: torch.Tensor) -> torch.Tensor:
        # (x @ q^T) * s == x @ (q * s)^T: the scale after the product, so no dequantized copy is kept
        return F.linear(rows, self.q.to(rows.dtype)) * self.scales.to(rows.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] as it multiplies, in float32."""
        return dequantize_rows(self.q, self.scales.view(-1, 1))

    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scales.numel() * self.scales.element_size()


def describe(weights: list[Fp8Weight]) -> str:
    """One line for the log: how many GEMMs take _scaled_mm, and why the others do not."""
    reasons = sorted({w.fallback_reason for w in weights if not w.use_scaled_mm and w.fallback_reason})
    fast = sum(w.use_scaled_mm for w in weights)
    line = f"weights: fp8: {fast} of {len(weights)} GEMMs through torch._scaled_mm"
    if fast == len(weights):
        return line
    return f"{line}; the others multiply their dequantized weights (slower) because {'; '.join(reasons)}"
