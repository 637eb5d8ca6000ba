"""Linear layers that shard across a tensor-parallel group (Megatron column/row split).

At TP=1 they are plain linear layers. Each parameter knows how to take its slice of a full
checkpoint tensor (`load`), so the model's weight loading is the same at any TP size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disagg.engine.layers.cpu_gemm import PackedWeight
from disagg.engine.layers.parallel import SINGLE, TPGroup


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; no communication. Shards are named parts of the
    output (e.g. q, k, v of a fused QKV projection), each split across ranks separately."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        tp: TPGroup = SINGLE,
        gemm: str = "onednn",
    ):
        super().__init__()
        self.tp = tp
        self.local_sizes = {name: tp.shard(n, name) for name, n in shard_sizes.items()}
        self.offsets: dict[str, int] = {}
        offset = 0
        for name, n in self.local_sizes.items():
            self.offsets[name] = offset
            offset += n
        self.weight = nn.Parameter(torch.empty(offset, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(offset), requires_grad=False) if bias else None
        self.packed = PackedWeight(gemm)  # the CPU fp32 fast path (layers/cpu_gemm.py)

    def load(self, shard: str, full: torch.Tensor, is_bias: bool = False) -> None:
        n = self.local_sizes[shard]
        part = full.narrow(0, self.tp.rank * n, n)
        target = self.bias if is_bias else self.weight
        target.data.narrow(0, self.offsets[shard], n).copy_(part)

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        """`decode_rows`: the step's leading rows that decode a generated token (a quantized weight
        takes its kernel for those: layers/quantized.py); None outside an engine step."""
        return self.packed.linear(x, self.weight, self.bias, decode_rows)

    @property
    def fuses_silu_mul(self) -> bool:
        """Whether its weight computes silu(gate) * up of a [gate; up] projection itself (a
        quantized weight, with a kernel for it on CPU)."""
        return hasattr(self.packed, "silu_mul") and self.bias is None

    def silu_mul(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        """silu(gate) * up of a [gate; up] projection: one kernel where a quantized weight has one."""
        if self.fuses_silu_mul:
            return self.packed.silu_mul(x, decode_rows)
        gate, up = self(x, decode_rows).chunk(2, dim=-1)
        return F.silu(gate) * up


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial sums all-reduced."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp: TPGroup = SINGLE, gemm: str = "onednn"
    ):
        super().__init__()
        self.tp = tp
        self.local_in = tp.shard(in_features, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed = PackedWeight(gemm)

    def load(self, full: torch.Tensor) -> None:
        self.weight.data.copy_(full.narrow(1, self.tp.rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        out = self.tp.all_reduce(self.packed.linear(x, self.weight, None, decode_rows))
        return out if self.bias is None else out + self.bias
