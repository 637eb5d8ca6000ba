"""Which KV slices move from which prefill rank to which decode rank, when the two pools use
different parallel plans.

Tensor parallelism splits KV heads evenly across TP ranks; pipeline parallelism splits layers
across stages (disagg.engine.partition, the model's own split). A route is the intersection of
what one prefill rank holds with what one decode rank needs. Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.engine.partition import head_range, layer_range


@dataclass(frozen=True)
class ParallelPlan:
    tp: int = 1
    pp: int = 1

    def ranks(self) -> list[tuple[int, int]]:
        """(tp_rank, pp_rank) of every worker of the instance."""
        return [(t, p) for p in range(self.pp) for t in range(self.tp)]


@dataclass(frozen=True)
class KVRoute:
    src: tuple[int, int]  # (tp_rank, pp_rank) on the prefill side
    dst: tuple[int, int]  # (tp_rank, pp_rank) on the decode side
    layers: tuple[int, int]  # global [start, end)
    heads: tuple[int, int]  # global KV heads [start, end)
    src_layer_offset: int  # first global layer the source rank holds (its local layer 0)
    src_head_offset: int
    dst_layer_offset: int
    dst_head_offset: int

    def src_local(self) -> tuple[slice, slice]:
        """(layers, heads) slices into the source rank's local cache."""
        return _local(self.layers, self.src_layer_offset), _local(self.heads, self.src_head_offset)

    def dst_local(self) -> tuple[slice, slice]:
        return _local(self.layers, self.dst_layer_offset), _local(self.heads, self.dst_head_offset)


def plan_kv_routes(num_layers: int, num_kv_heads: int, src: ParallelPlan, dst: ParallelPlan) -> list[KVRoute]:
    """Every non-empty (prefill rank -> decode rank) slice; together they cover each decode
    rank's (layer, head) range exactly once."""
    routes = []
    for src_tp, src_pp in src.ranks():
        s_layers, s_heads = layer_range(num_layers, src_pp, src.pp), head_range(num_kv_heads, src_tp, src.tp)
        for dst_tp, dst_pp in dst.ranks():
            d_layers, d_heads = layer_range(num_layers, dst_pp, dst.pp), head_range(num_kv_heads, dst_tp, dst.tp)
            layers, heads = _intersect(s_layers, d_layers), _intersect(s_heads, d_heads)
            if layers and heads:
                routes.append(
                    KVRoute(
                        (src_tp, src_pp),
                        (dst_tp, dst_pp),
                        layers,
                        heads,
                        s_layers[0],
                        s_heads[0],
                        d_layers[0],
                        d_heads[0],
                    )
                )
    return routes


def _intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    start, end = max(a[0], b[0]), min(a[1], b[1])
    return (start, end) if start < end else None


def _local(global_range: tuple[int, int], offset: int) -> slice:
    return slice(global_range[0] - offset, global_range[1] - offset)
