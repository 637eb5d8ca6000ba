"""Weights kept 8- or 4-bit in memory, multiplied without making them dense again.

A decode step at small batches reads every weight once, so its time is the weights' bytes over
the memory bandwidth: 4-bit weights are read 8x faster than float32 ones. Two kernel families:

- ours (csrc/quantized_gemv.cpp, `kernels`: torch.ops.disagg_cpu), the default on CPU where the
  C++ kernels build: float32 rows in and out, the rows quantized to int8 blocks and each block's
  dot product taken in integers (VNNI or AVX2), as llama.cpp computes; the MLP's gate and up
  projections and the SiLU between them are one call.
- torch's (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), where ours did not build
  (attention_backend: torch). Their float32-input path is scalar and 10-20x slower than their
  bfloat16 one on this project's AVX-512 host (RESULTS.md, "Quantized weights"), so activations
  enter them as bfloat16.

A prompt's rows take a packed float copy of the same dequantized weights instead: float32 by
default (EngineConfig.prompt_precision, on every instance), so a prompt is computed as the
reference computes it (transformers on the dequantized GGUF): its first token is the reference's own, even where two
tokens nearly tie (SmolLM2's "What is the capital of France?": 0.08 nats between "The" and "L'",
which bfloat16 products or int8 activations flip). The vocabulary projection has no such copy:
its prompt rows take the int8 weights with float32 activations (q8_gemv_exact).

Which path a row takes depends on what the row is, never on how many rows its step holds: a
decode's row takes our kernel however many decode beside it (at 32 decodes the float copy made
a step ~10% faster, at 8 the kernel is the faster, but with the copy past 4 a greedy request's
text depended on how busy the engine was: loadtest/results/batch_invariance.md), a prompt's
rows the copy however few they are. Each
path gives a row the same bits in any batch: our kernels compute every row alone (in registers
of its own, in a fixed order), and oneDNN's float32 GEMM over a prepacked weight keeps each
row's sums whatever the number of rows, from 2 (one row is paired with itself: _wide_product).

Formats:
- int4: groups of 32 weights along the input, each with its scale and offset (w = scale * q +
  low, q in 0..15). GGUF's Q4_0 and Q4_1 blocks are exactly this (32 weights, a scale, and for
  Q4_1 a minimum), so a GGUF quantized so is kept at its own values: a Q4_1 block's minimum and
  maximum give back its scale and minimum, a Q4_0 block's largest magnitude its scale. Our
  kernel keeps GGUF's Q4_1 block layout (float16 scale and offset); torch's keeps bfloat16 ones.
- int8: for our kernel, a scale per 32 weights (GGUF's Q8_0, kept exactly); for torch's, one
  scale per output row. Used for GGUF's Q8_0 and 5/6-bit formats (a small rounding of their
  values) and for the vocabulary projection (with a tied embedding, its int8 blocks are shared:
  disagg.engine.models.causal_lm.QuantizedEmbedding).
"""

from __future__ import annotations

import torch

from disagg.engine.layers.cpu_gemm import onednn_enabled

QUANTIZED_FORMATS = ("int8", "int4")
INT4_GROUP = 32  # GGUF's block size; torch's int4 kernel takes 32, 64, 128 or 256
_INT4_INNER_K_TILES = 2  # the packing's tile count: what the CPU kernel is built for
_TORCH_KERNEL_DTYPE = torch.bfloat16  # what torch's weight-only kernels compute in
# The copy for prompt rows: float32 by default (the reference's own products), bfloat16 with
# EngineConfig.prompt_precision = bf16 (`wide_dtype_for`).
_WIDE_DTYPES = (torch.float32, torch.bfloat16)
# Rows multiplied at once above which a oneDNN GEMM over the dequantized weights beats
# torch's weight-only kernels: those read 4- or 8-bit weights, which is what a decode step of a
# few requests is bound by, but compute poorly on many rows (at 8 rows of SmolLM2's MLP: 114 us
# against 59; at 1 row: 36 against 53; RESULTS.md, "Quantized weights"). Ours take every
# decode row (no such limit): see the module's docstring.
QUANTIZED_MAX_ROWS = 4


class _QuantizedGemm:
    """A weight kept quantized for steps of few rows, with a float32 packed copy of the same
    (dequantized) values for steps of many (prefill chunks, large decode batches)."""

    shape: tuple[int, int]
    _wide: torch.Tensor | None = None
    wide_dtype: torch.dtype = torch.float32
    # A step's decode rows take the quantized kernel while there are at most this many (None:
    # however many, as with ours: a decode's numbers then never depend on the batch); beyond,
    # torch's kernels are slower than the copy.
    max_narrow_decodes: int | None = QUANTIZED_MAX_ROWS
    # Every row, prompt rows too, on the quantized kernel (EngineConfig.batch_invariant): a row's
    # numbers then depend on nothing else in the step, and a prompt recomputed with the tokens a
    # decode generated (a migration) gets the numbers those tokens were decoded with.
    every_row_narrow: bool = False

    def linear(
        self, x: torch.Tensor, _dense=None, bias: torch.Tensor | None = None, decode_rows: int | None = None
    ) -> torch.Tensor:
        """As PackedWeight.linear, whose dense weight argument is ignored here (the weight is this).
        `decode_rows`: within an engine step, how many leading rows decode a generated token (the
        step's AttentionMetadata.decode_rows); None: outside one."""
        rows = x if x.dim() == 2 else x.reshape(-1, self.shape[1])
        narrow = self._narrow_rows(rows.shape[0], decode_rows)
        if narrow == rows.shape[0]:
            out = self._narrow(rows)
        elif narrow == 0:
            out = self._wide_product(rows)
        else:
            out = torch.cat([self._narrow(rows[:narrow]), self._wide_product(rows[narrow:])])
        if x.dim() != 2:
            out = out.view(*x.shape[:-1], self.shape[0])
        return out if bias is None else out + bias

    def _narrow_rows(self, num_rows: int, decodes: int | None) -> int:
        """How many of the leading rows take the quantized kernel, the rest the float copy.

        Within an engine step (`decodes`: its leading rows that decode a generated token) prompt
        rows always take the copy (float32: the first token is the reference's), and a decode's
        row the kernel (with torch's, while the step has at most `max_narrow_decodes` of them).
        Outside a step (None): by count."""
        if self.every_row_narrow or not self._has_wide_path():
            return num_rows
        if decodes is None:
            return num_rows if num_rows <= QUANTIZED_MAX_ROWS else 0
        if self.max_narrow_decodes is not None and decodes > self.max_narrow_decodes:
            return 0
        return min(decodes, num_rows)

    def _has_wide_path(self) -> bool:
        return self._wide is not None

    def _wide_product(self, rows: torch.Tensor) -> torch.Tensor:
        wide = rows.to(self.wide_dtype).contiguous()
        if wide.shape[0] == 1:
            # oneDNN takes a lone row down another path (a GEMV, past ~1k inputs) whose sums
            # differ in the last bits from the same row's among others: a prompt whose cached
            # prefix leaves one row to compute would then differ from the same prompt uncached.
            return self._wide_product(wide.expand(2, -1).contiguous())[:1].to(rows.dtype)
        return torch.ops.mkldnn._linear_pointwise(wide, self._wide, None, "none", [], "").to(rows.dtype)

    def silu_mul(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        """silu(gate) * up of a fused [gate; up] weight's product with x."""
        gate, up = self.linear(x, decode_rows=decode_rows).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def _narrow(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, in] -> [n, out], in rows' dtype: the quantized kernel."""
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The weights as the kernel sees them, [out, in] float32."""
        raise NotImplementedError

    def _pack_wide(self, values: torch.Tensor) -> None:
        """`values`: the dequantized weights, [out, in]."""
        if onednn_enabled():
            self._wide = torch.ops.mkldnn._reorder_linear_weight(values.to(self.wide_dtype).contiguous(), 32)

    @property
    def nbytes(self) -> int:
        """Bytes held, the packed float copy included."""
        wide = self._wide.numel() * self._wide.element_size() if self._wide is not None else 0
        return self._own_bytes() + wide

    def _own_bytes(self) -> int:
        raise NotImplementedError


class Int8Weight(_QuantizedGemm):
    """[out, in] int8 with a scale per block of 32 inputs (our kernel) or per output row (torch's)."""

    def __init__(self, weight: torch.Tensor, kernels=None, wide_dtype: torch.dtype = torch.float32):
        self.kernels, self.wide_dtype = kernels, _checked_wide_dtype(wide_dtype)
        self.max_narrow_decodes = _max_narrow_decodes(kernels)
        self.shape = tuple(weight.shape)
        if kernels is not None:
            self.q, self.scales = int8_blocks(weight)
        else:
            w = weight.detach().float()
            scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
            self.q = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
            self.scales = scales.to(_TORCH_KERNEL_DTYPE)
        self._pack_wide(self.dequantized())

    @classmethod
    def of_blocks(cls, q: torch.Tensor, scales: torch.Tensor, kernels) -> "Int8Weight":
        """Our kernel over int8 blocks held elsewhere (q [out, in], scales [out, in / 32]
        float32: a tied embedding's), shared rather than copied."""
        weight = cls.__new__(cls)
        weight.kernels, weight.shape, weight.q, weight.scales = kernels, tuple(q.shape), q, scales
        weight.max_narrow_decodes = _max_narrow_decodes(kernels)
        return weight

    def without_wide_copy(self) -> "Int8Weight":
        """No float copy (ours only): for the vocabulary projection, whose rows are the step's
        sampled ones. Every decode row takes the int8 kernel however many there are, and every
        prompt row the exact one (q8_gemv_exact), so a request's logits never depend on how
        many others were sampled with it (oneDNN picks its kernel by the number of rows), and
        no float copy of the vocabulary (113 MiB for SmolLM2) is kept."""
        if self.kernels is not None:
            self._wide = None
        return self

    def _has_wide_path(self) -> bool:
        return self._wide is not None or self.kernels is not None

    def _wide_product(self, rows: torch.Tensor) -> torch.Tensor:
        if self._wide is None:
            return _in_dtype(self.kernels.q8_gemv_exact(_float(rows), self.q, self.scales), rows.dtype)
        return super()._wide_product(rows)

    def _narrow(self, rows: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return _in_dtype(self.kernels.q8_gemv(_float(rows), self.q, self.scales), rows.dtype)
        return torch._weight_int8pack_mm(rows.to(_TORCH_KERNEL_DTYPE), self.q, self.scales).to(rows.dtype)

    def dequantized(self) -> torch.Tensor:
        if self.kernels is not None:
            out, inp = self.shape
            return (self.q.float().view(out, -1, INT4_GROUP) * self.scales[..., None]).view(out, inp)
        return self.q.float() * self.scales.float()[:, None]

    def _own_bytes(self) -> int:
        return self.q.numel() + self.scales.numel() * self.scales.element_size()


def wide_dtype_for(prompt_precision: str = "fp32") -> torch.dtype:
    """The prompt rows' copy's dtype: `prompt_precision` (EngineConfig; fp32: a prompt's first
    token the reference's). A decode instance's too: the prompts it computes (after a role
    switch, a preemption) then give what a prefill instance's would, at the cost of the copy's
    bytes (SmolLM2-135M: 425 MiB in float32, 212 in bfloat16)."""
    return torch.float32 if prompt_precision == "fp32" else torch.bfloat16


def _max_narrow_decodes(kernels) -> int | None:
    """Ours take every decode row of a step (None), torch's at most QUANTIZED_MAX_ROWS."""
    return None if kernels is not None else QUANTIZED_MAX_ROWS


def _checked_wide_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in _WIDE_DTYPES:
        raise ValueError(f"quantized weights: the many-row copy is float32 or bfloat16, not {dtype}")
    return dtype


def _float(x: torch.Tensor) -> torch.Tensor:
    """Our kernels take float32 (checked without a call into torch: a decode step makes hundreds)."""
    return x if x.dtype == torch.float32 else x.float()


def _in_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out if dtype == torch.float32 else out.to(dtype)


def int8_blocks(weight: torch.Tensor, block: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 q [out, in], float32 scales [out, in / block]): GGUF's Q8_0 grid."""
    out, inp = weight.shape
    blocks = weight.detach().float().view(out, inp // block, block)
    scales = (blocks.abs().amax(dim=-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = (blocks / scales[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return q.view(out, inp), scales


class Int4Weight(_QuantizedGemm):
    """[out, in] in groups of INT4_GROUP input weights, each with a scale and an offset."""

    def __init__(
        self,
        weight: torch.Tensor,
        group: int = INT4_GROUP,
        symmetric: bool = False,
        kernels=None,
        wide_dtype: torch.dtype = torch.float32,
    ):
        """`symmetric`: w = scale * (q - 8), the scale set by the group's largest magnitude
        (GGUF's Q4_0); else w = scale * q + low over the group's range (Q4_1, and float weights).
        `kernels`: ours (their block layout, group 32), else torch's."""
        out_features, in_features = weight.shape
        if in_features % group:
            raise ValueError(f"int4: {in_features} input features are not a multiple of the group size {group}")
        if kernels is not None and group != INT4_GROUP:
            raise ValueError(f"int4: the CPU kernels take groups of {INT4_GROUP}, not {group}")
        q, scales, low = _int4_grid(weight.detach().float().view(out_features, in_features // group, group), symmetric)
        self.kernels, self.group, self.shape = kernels, group, (out_features, in_features)
        self.wide_dtype = _checked_wide_dtype(wide_dtype)
        self.max_narrow_decodes = _max_narrow_decodes(kernels)
        if kernels is not None:
            scales, low = scales.half(), low.half()  # GGUF's own float16 scale and minimum
            self.blocks = _q4_blocks(q, scales, low)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.view(out_features, in_features), _INT4_INNER_K_TILES
            )
            # The kernel's layout: [groups, out, 2] of (scale, zero) with w = scale * (q - 8) + zero.
            zeros = low + 8 * scales
            self.scales_and_zeros = (
                torch.stack([scales, zeros], -1).transpose(0, 1).contiguous().to(_TORCH_KERNEL_DTYPE)
            )
            scales, zeros = (t.float() for t in self.scales_and_zeros.transpose(0, 1).unbind(-1))
            low = zeros - 8 * scales
        # The kernel's own values (its rounded scales): both paths compute one weight.
        values = q.float() * scales.float()[..., None] + low.float()[..., None]
        self._pack_wide(values.view(out_features, in_features))

    def _narrow(self, rows: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return _in_dtype(self.kernels.q4_gemv(_float(rows), self.blocks), rows.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.to(_TORCH_KERNEL_DTYPE), self.packed, self.group, self.scales_and_zeros
        )
        return out.to(rows.dtype)

    def silu_mul(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        narrow = self._narrow_rows(x.shape[0], decode_rows) if self.kernels is not None and x.dim() == 2 else 0
        if narrow == 0:
            return super().silu_mul(x, decode_rows)
        # A decode's row takes the fused kernel (its SiLU too) beside prefill rows as well as alone.
        fused = _in_dtype(self.kernels.q4_gemv_silu_mul(_float(x[:narrow]), self.blocks), x.dtype)
        if narrow == x.shape[0]:
            return fused
        gate, up = self._wide_product(x[narrow:]).chunk(2, dim=-1)
        return torch.cat([fused, torch.nn.functional.silu(gate) * up])

    def dequantized(self) -> torch.Tensor:
        if self.kernels is not None:
            return _q4_values(self.blocks, self.shape)
        return self._narrow(torch.eye(self.shape[1])).T.contiguous()

    def _own_bytes(self) -> int:
        if self.kernels is not None:
            return self.blocks.numel()
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 2


def _int4_grid(w: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, groups, group] -> (q [out, groups, group] int32 in 0..15, scale, low [out, groups])."""
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:  # the extreme maps to q = 0 (as Q4_0 does): a signed scale
        extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        scales = torch.where(extreme.abs() < tiny, torch.full_like(extreme, tiny), extreme / -8)
        low = -8 * scales
    else:
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((high - low) / 15).clamp_min(tiny)
    q = ((w - low[..., None]) / scales[..., None]).round_().clamp_(0, 15).to(torch.int32)
    return q, scales, low


def _q4_blocks(q: torch.Tensor, scales: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """GGUF's Q4_1 layout, [out, groups * 20] uint8: per block float16 scale, float16 minimum,
    then 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31."""
    out, groups, _ = q.shape
    nibbles = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
    head = torch.stack([scales, low], dim=-1).contiguous().view(torch.uint8).view(out, groups, 4)
    return torch.cat([head, nibbles], dim=-1).view(out, groups * 20).contiguous()


def _q4_values(blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """_q4_blocks' weights, [out, in] float32."""
    out, groups = shape[0], shape[1] // INT4_GROUP
    b = blocks.view(out, groups, 20)
    scales, low = b[..., :4].contiguous().view(torch.float16).float().unbind(-1)
    nibbles = b[..., 4:].to(torch.int32)
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
    return (q * scales[..., None] + low[..., None]).view(shape)


def quantize(
    weight: torch.Tensor,
    fmt: str,
    gguf_types: list[str | None] = (),
    kernels=None,
    wide_dtype: torch.dtype = torch.float32,
) -> _QuantizedGemm:
    """`weight` [out, in] as `fmt` (one of QUANTIZED_FORMATS); `gguf_types`: what it was stored
    as, so that 4-bit blocks keep their own grid; `kernels`: ours (torch.ops.disagg_cpu), else
    torch's; `wide_dtype`: the dtype of the copy for steps of many rows."""
    if weight.device.type != "cpu":
        raise ValueError(
            f"weights: {fmt} runs on CPU only so far; use weights: auto or a float dtype on {weight.device}"
        )
    if kernels is not None and weight.shape[1] % INT4_GROUP:
        kernels = None  # ours take whole blocks of 32 inputs
    if fmt == "int8":
        return Int8Weight(weight, kernels, wide_dtype)
    if fmt == "int4":
        symmetric = bool(gguf_types) and all(t == "Q4_0" for t in gguf_types)
        return Int4Weight(weight, symmetric=symmetric, kernels=kernels, wide_dtype=wide_dtype)
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
