"""Whether the cluster has room for one more whole instance of a pool (issue 53, item 3).

An instance is a placement group of `workers_per_instance` equal bundles (disagg.cluster.launcher):
with tensor parallelism only, all on one node (STRICT_PACK); with pipeline stages, over any nodes
(PACK). Room is judged on each node's available resources as Ray reports them, the bundle
including the pool's labels (a labelled pool fits only on nodes that carry its label).
"""

from __future__ import annotations

EPSILON = 1e-9  # Ray's resource amounts are fixed-point: a sliver's rounding is not a shortfall


def bundles_on(node: dict[str, float], bundle: dict[str, float]) -> int:
    """How many `bundle`s one node's available resources hold."""
    counts = [int((node.get(name, 0.0) + EPSILON) // amount) for name, amount in bundle.items() if amount > 0]
    return min(counts) if counts else 0


def has_room(nodes: list[dict[str, float]], bundle: dict[str, float], count: int, one_node: bool) -> bool:
    """Whether `count` bundles fit in `nodes` (each node's available resources): all on one
    node when `one_node`, else spread over any."""
    fits = [bundles_on(node, bundle) for node in nodes]
    if one_node:
        return any(f >= count for f in fits)
    return sum(fits) >= count
