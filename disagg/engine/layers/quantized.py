"""Weights kept 8- or 4-bit in memory, multiplied by torch's CPU weight-only kernels.

A decode step at small batches reads every weight once, so its time is the weights' bytes over
the memory bandwidth: 4-bit weights are read 8x faster than float32 ones. The kernels are
torch's (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`). Their float32-input path is
scalar and 10-20x slower than their bfloat16 one on this project's AVX-512 host (RESULTS.md,
"Quantized weights"), so activations enter them as bfloat16 and leave as the model's dtype.

- int4: groups of 32 weights along the input, each with its scale and offset, asymmetric
  (w = scale * (q - 8) + zero). GGUF's Q4_0 and Q4_1 blocks are exactly this (32 weights, a
  scale, and for Q4_1 a minimum), so a GGUF quantized so is kept at its own values: a Q4_1
  block's minimum and maximum give back its scale and minimum, a Q4_0 block's largest magnitude
  its scale.
- int8: one scale per output row, symmetric. Used for GGUF's Q8_0 and 5/6-bit formats (a small
  rounding of their values) and for the vocabulary projection (a tied embedding keeps int8 rows
  of its own, in blocks: disagg.engine.models.llama.QuantizedEmbedding).
"""

from __future__ import annotations

import torch

from disagg.engine.layers.cpu_gemm import onednn_enabled

QUANTIZED_FORMATS = ("int8", "int4")
INT4_GROUP = 32  # GGUF's block size; torch's int4 kernel takes 32, 64, 128 or 256
_INT4_INNER_K_TILES = 2  # the packing's tile count: what the CPU kernel is built for
_COMPUTE_DTYPE = torch.bfloat16
# Rows multiplied at once above which a bfloat16 oneDNN GEMM over the dequantized weights beats
# torch's weight-only kernels: those read 4- or 8-bit weights, which is what a decode step of a
# few requests is bound by, but compute poorly on many rows (at 8 rows of SmolLM2's MLP: 114 us
# against 59; at 1 row: 36 against 53; RESULTS.md, "Quantized weights").
QUANTIZED_MAX_ROWS = 4


class _QuantizedGemm:
    """A weight kept quantized for steps of few rows, with a bfloat16 packed copy of the same
    (dequantized) values for steps of many (prefill chunks, large decode batches)."""

    shape: tuple[int, int]
    _wide: torch.Tensor | None = None

    def linear(self, x: torch.Tensor, _dense=None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """As PackedWeight.linear, whose dense weight argument is ignored here (the weight is this)."""
        rows = x.to(_COMPUTE_DTYPE)
        if self._wide is not None and x.dim() == 2 and x.shape[0] > QUANTIZED_MAX_ROWS:
            out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self._wide, None, "none", [], "")
        else:
            out = self._narrow(rows)
        out = out.to(x.dtype)
        return out if bias is None else out + bias

    def _narrow(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        raise NotImplementedError

    def _pack_wide(self, values: torch.Tensor) -> None:
        """`values`: the dequantized weights, [out, in]."""
        if onednn_enabled():
            self._wide = torch.ops.mkldnn._reorder_linear_weight(values.to(_COMPUTE_DTYPE), 32)

    @property
    def nbytes(self) -> int:
        """Bytes held, the packed bfloat16 copy included."""
        wide = self._wide.numel() * self._wide.element_size() if self._wide is not None else 0
        return self._own_bytes() + wide

    def _own_bytes(self) -> int:
        raise NotImplementedError


class Int8Weight(_QuantizedGemm):
    """[out, in] int8 with one scale per output row."""

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        self.q = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        self.scales = scales.to(_COMPUTE_DTYPE)
        self.shape = tuple(weight.shape)
        self._pack_wide(self.dequantized())

    def _narrow(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.q, self.scales)

    def dequantized(self) -> torch.Tensor:
        return self.q.float() * self.scales.float()[:, None]

    def _own_bytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


class Int4Weight(_QuantizedGemm):
    """[out, in] in groups of INT4_GROUP input weights, each with a scale and an offset."""

    def __init__(self, weight: torch.Tensor, group: int = INT4_GROUP, symmetric: bool = False):
        """`symmetric`: w = scale * (q - 8), the scale set by the group's largest magnitude
        (GGUF's Q4_0); else w = scale * q + low over the group's range (Q4_1, and float weights)."""
        out_features, in_features = weight.shape
        if in_features % group:
            raise ValueError(f"int4: {in_features} input features are not a multiple of the group size {group}")
        w = weight.detach().float().view(out_features, in_features // group, group)
        tiny = torch.finfo(torch.float32).tiny
        if symmetric:  # the extreme maps to q = 0 (as Q4_0 does): a signed scale
            extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
            scales = torch.where(extreme.abs() < tiny, torch.full_like(extreme, tiny), extreme / -8)
            low = -8 * scales
        else:
            low, high = w.amin(dim=-1), w.amax(dim=-1)
            scales = ((high - low) / 15).clamp_min(tiny)
        q = ((w - low[..., None]) / scales[..., None]).round_().clamp_(0, 15).to(torch.int32)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.view(out_features, in_features), _INT4_INNER_K_TILES
        )
        # The kernel's layout: [groups, out, 2] of (scale, zero) with w = scale * (q - 8) + zero.
        zeros = low + 8 * scales
        self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(_COMPUTE_DTYPE)
        self.group = group
        self.shape = (out_features, in_features)
        # The kernel's values, from its bfloat16 scales and zeros: both paths compute one weight.
        scales, zeros = (t.float() for t in self.scales_and_zeros.transpose(0, 1).unbind(-1))
        values = (q.float() - 8) * scales[..., None] + zeros[..., None]
        self._pack_wide(values.view(out_features, in_features))

    def _narrow(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scales_and_zeros)

    def dequantized(self) -> torch.Tensor:
        """The weights as the kernel sees them, in float32."""
        return self._narrow(torch.eye(self.shape[1], dtype=_COMPUTE_DTYPE)).float().T.contiguous()

    def _own_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 2


def quantize(weight: torch.Tensor, fmt: str, gguf_types: list[str | None] = ()) -> Int8Weight | Int4Weight:
    """`weight` [out, in] as `fmt` (one of QUANTIZED_FORMATS); `gguf_types`: what it was stored
    as, so that 4-bit blocks keep their own grid."""
    if weight.device.type != "cpu":
        raise ValueError(
            f"weights: {fmt} runs on CPU only so far; use weights: auto or a float dtype on {weight.device}"
        )
    if fmt == "int8":
        return Int8Weight(weight)
    if fmt == "int4":
        return Int4Weight(weight, symmetric=bool(gguf_types) and all(t == "Q4_0" for t in gguf_types))
    raise ValueError(f"weights: {fmt!r} is not one of {QUANTIZED_FORMATS}")


# GGUF storage types the engine keeps as int4 (their own values); any other quantized type is
# kept as int8 (5-, 6- and 8-bit blocks: a small rounding).
_GGUF_INT4 = ("Q4_0", "Q4_1")
_GGUF_FLOAT = ("F32", "F16", "BF16", "F64")


def weight_format(setting: str, gguf_types: list[str | None]) -> str | None:
    """The format a weight is kept in (None: dense, in the model's dtype). `setting` is
    EngineConfig.weights; `gguf_types` the GGUF types of the checkpoint tensors it is made of
    (None where the checkpoint is not a GGUF)."""
    if setting in QUANTIZED_FORMATS:
        return setting
    if setting != "auto" or not gguf_types or any(t is None or t in _GGUF_FLOAT for t in gguf_types):
        return None
    return "int4" if all(t in _GGUF_INT4 for t in gguf_types) else "int8"
