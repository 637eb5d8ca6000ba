"""The experts of one mixture-of-experts layer held by this rank, and their grouped products.

The weights are stacked as transformers (5.x) holds them in memory: gate and up fused,
[experts, 2 * intermediate, hidden], and down, [experts, hidden, intermediate]. Under tensor
parallelism without expert parallelism every rank holds every expert and a slice of each one's
intermediate size (gate and up by rows, down by columns; the MoE layer all-reduces the sum);
under expert parallelism a rank holds whole experts, a contiguous range of them.

A step's rows come grouped by expert (`counts[e]` rows for local expert e, in order); each expert
with rows makes two GEMMs over all of its rows, gate/up with SiLU-mul, then down. After loading,
each expert's pair of weights becomes one of:

- views of the stacks, multiplied by F.linear (CUDA, bfloat16, or cpu_gemm "torch");
- oneDNN-packed copies (CPU float32: as layers/cpu_gemm.py, about twice the speed of F.linear
  at a few rows), which replace the stacks rather than doubling them;
- quantized weights (layers/quantized.py), one Int4Weight or Int8Weight per expert matrix: the
  kernels take any [out, in] matrix, so an expert's is just a small one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disagg.engine.layers.cpu_gemm import PACK_BATCH_HINT, onednn_enabled
from disagg.engine.layers.parallel import SINGLE, TPGroup
from disagg.engine.layers.quantized import quantize, weight_format

EXPERT_PARTS = ("gate", "up", "down")


def padded_rows(rows: int) -> int:
    """The row count an expert's packed GEMM runs at: oneDNN builds (and caches, a few hundred
    at most) a kernel per row count, and an expert's rows vary every step (a dense layer's are
    the step's tokens), so counts round up to few sizes: exact to 4, then 8, then four sizes an
    octave (12, 16, 20, 24, 28, 32, 40, ...): past 16 rows, less than a quarter more rows; below,
    the product is bound by reading the weights, not by rows."""
    if rows <= 4:
        return rows
    if rows <= 8:
        return 8
    step = 1 << max(2, (rows - 1).bit_length() - 3)
    return -(-rows // step) * step


class _DenseGemm:
    """One expert matrix [out, in] as a float weight: a view of the stack, or a packed copy."""

    def __init__(self, weight: torch.Tensor, pack: bool):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT) if pack else None
        self.weight = None if pack else weight  # packed: the stack it viewed can go

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight)
        rows = x.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, None, "none", [], "")
        return out if padded == rows else out[:rows]

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear(x).chunk(2, dim=-1)
        return F.silu(gate) * up


class Experts(nn.Module):
    def __init__(
        self,
        num_local_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TPGroup = SINGLE,
        gemm: str = "onednn",
    ):
        """`tp`: the group the intermediate size is split over (SINGLE under expert parallelism)."""
        super().__init__()
        self.tp, self.gemm = tp, gemm
        self.num_local_experts = num_local_experts
        self.intermediate = tp.shard(intermediate_size, "moe_intermediate_size")
        i = self.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_local_experts, 2 * i, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_local_experts, hidden_size, i), requires_grad=False)
        self.gemms: list[tuple] = []  # per local expert: (gate_up, down), set by `prepare`
        self.quantized = False

    # ---- loading -----------------------------------------------------------------------------
    def load(self, expert: int, part: str, full: torch.Tensor) -> None:
        """One local expert's `part` (EXPERT_PARTS) from the checkpoint's full matrix."""
        i, rank = self.intermediate, self.tp.rank
        if part == "down":
            self.down_proj.data[expert].copy_(full.narrow(1, rank * i, i))
            return
        offset = 0 if part == "gate" else i
        self.gate_up_proj.data[expert].narrow(0, offset, i).copy_(full.narrow(0, rank * i, i))

    def prepare(self) -> None:
        """Each expert's GEMMs, once its weights are loaded: packed where oneDNN applies (the
        stacks are then freed), views of the stacks otherwise; quantized ones are ready already."""
        if self.quantized:
            return
        pack = self._packs()
        self.gemms = [
            (_DenseGemm(self.gate_up_proj[e], pack), _DenseGemm(self.down_proj[e], pack))
            for e in range(self.num_local_experts)
        ]
        if pack:
            self._free_stacks()

    def _packs(self) -> bool:
        w = self.gate_up_proj
        return onednn_enabled(self.gemm) and w.device.type == "cpu" and w.dtype == torch.float32 and w.numel() > 0

    def quantize(self, setting: str, gguf_types: list[list[str | None]], kernels, wide_dtype: torch.dtype) -> bool:
        """Keep the experts quantized where `setting` (EngineConfig.weights) says so; `gguf_types`:
        per local expert, the GGUF types of its gate, up and down matrices. False: left dense."""
        formats = [(weight_format(setting, types[:2]), weight_format(setting, types[2:])) for types in gguf_types]
        if any(f is None for pair in formats for f in pair):
            return False
        self.gemms = [
            (
                quantize(self.gate_up_proj.data[e], up_fmt, types[:2], kernels, wide_dtype),
                quantize(self.down_proj.data[e], down_fmt, types[2:], kernels, wide_dtype),
            )
            for e, ((up_fmt, down_fmt), types) in enumerate(zip(formats, gguf_types))
        ]
        self.quantized = True
        self._free_stacks()
        return True

    def every_row_quantized(self) -> None:
        for gemm in (g for pair in self.gemms for g in pair):
            if hasattr(gemm, "every_row_narrow"):
                gemm.every_row_narrow = True

    def _free_stacks(self) -> None:
        empty = torch.empty(0, dtype=self.gate_up_proj.dtype, device=self.gate_up_proj.device)
        self.gate_up_proj = nn.Parameter(empty, requires_grad=False)
        self.down_proj = nn.Parameter(empty.clone(), requires_grad=False)

    # ---- compute -----------------------------------------------------------------------------
    def forward(self, rows: torch.Tensor, counts: list[int], decodes: list[int] | None = None) -> torch.Tensor:
        """rows [sum(counts), hidden], grouped by local expert -> each row through its expert.
        `decodes[e]`: how many of expert e's rows (its first) decode a generated token: a quantized
        expert takes its kernel for those (None: outside an engine step, by count)."""
        outs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                group = rows[start : start + count]
                outs.append(self._expert(expert, group, None if decodes is None else decodes[expert]))
                start += count
        if not outs:
            return rows.new_empty(0, rows.shape[1])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _expert(self, expert: int, rows: torch.Tensor, decodes: int | None) -> torch.Tensor:
        gate_up, down = self.gemms[expert]
        if not self.quantized or decodes is None:
            return down.linear(gate_up.silu_mul(rows))
        # quantized: this expert's own decode rows lead
        return down.linear(gate_up.silu_mul(rows, decodes), decode_rows=decodes)
