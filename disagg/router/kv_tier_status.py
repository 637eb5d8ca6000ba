"""An instance's KV tiers and prefix index, flat (`"hit_blocks.host": 12`), as `disagg status`
and the metrics show them."""

from __future__ import annotations


def flat_kv_tiers(report: dict, indexed_blocks: int) -> dict[str, float]:
    """`report`: the worker's LoadReport.kv_tiers ({} without tiers: nothing); `indexed_blocks`:
    the blocks the cluster-wide index lists for it, as the router last read it."""
    if not report:
        return {}
    flat: dict[str, float] = {"index.entries": float(indexed_blocks)}
    for key, value in report.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{name}": float(v) for name, v in value.items() if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)):
            flat[key] = float(value)
    return flat
