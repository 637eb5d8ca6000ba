"""How an instance's workers split a model: layers by pipeline stage, KV heads by tensor-parallel
rank. Pure arithmetic, shared by the model (which layers a stage builds), the KV cache (which heads
a rank holds) and the transfer's resharding (which slices move between two plans)."""

from __future__ import annotations


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers that pipeline stage `pp_rank` runs (earlier stages get the remainder)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def shard_size(n: int, tp_size: int, what: str) -> int:
    """n split evenly over tp_size ranks; ValueError when it does not divide."""
    if n % tp_size:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={tp_size}")
    return n // tp_size


def head_range(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the KV heads that tensor-parallel rank `tp_rank` holds."""
    per_rank = shard_size(num_kv_heads, tp_size, "num_key_value_heads")
    return tp_rank * per_rank, (tp_rank + 1) * per_rank
