"""The KV tiers' figures as `disagg status` and the metrics show them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from disagg.cli import _tiers_line
from disagg.engine.kv_tiers.tier_stats import TierStats
from disagg.metrics import ServingMetrics
from disagg.router.kv_tier_status import flat_kv_tiers


def _report() -> dict:
    stats = TierStats()
    stats.hit_blocks.update(pool=7, host=3)
    stats.loaded_bytes["host"] = 3 * 4096
    report = stats.to_dict({"host": 2**20}, {"host": 16})
    report["index"] = {"lag_s": 0.012, "republished": 1, "complete": True}
    return report


def test_status_shows_hits_held_bytes_and_the_index():
    flat = flat_kv_tiers(_report(), indexed_blocks=42)
    assert flat["hit_blocks.host"] == 3 and flat["index.entries"] == 42 and flat["index.lag_s"] == 0.012
    assert (
        _tiers_line(flat) == "kv tiers: hit blocks pool=7 host=3 disk=0; held host=1.0MiB; index 42 blocks, lag 12 ms"
    )
    assert flat_kv_tiers({}, 5) == {}  # no tiers: nothing shown


def test_metrics_by_tier_and_instance():
    metrics = ServingMetrics(CollectorRegistry())
    metrics.kv_tiers.set("p0", "prefill", flat_kv_tiers(_report(), indexed_blocks=42))
    text = generate_latest(metrics.registry).decode()
    assert 'disagg:kv_tier_hit_blocks_total{instance="p0",role="prefill",tier="host"} 3.0' in text
    assert 'disagg:kv_tier_loaded_bytes_total{instance="p0",role="prefill",tier="host"} 12288.0' in text
    assert 'disagg:kv_index_entries{instance="p0",role="prefill"} 42.0' in text
    metrics.remove_instance("p0", "prefill")
    assert 'instance="p0"' not in generate_latest(metrics.registry).decode()


def test_blocks_fetched_from_peers_show_in_status_and_metrics():
    flat = flat_kv_tiers({"peer": {"fetched_blocks": 5, "fetched_bytes": 5 * 2**20}}, indexed_blocks=0)
    assert _tiers_line(flat).endswith("; fetched from peers 5 blocks (5.0MiB)")
    assert "fetched from peers" not in _tiers_line(flat_kv_tiers(_report(), indexed_blocks=42))
    metrics = ServingMetrics(CollectorRegistry())
    metrics.kv_tiers.set("p1", "prefill", flat)
    text = generate_latest(metrics.registry).decode()
    assert 'disagg:kv_peer_fetched_blocks_total{instance="p1",role="prefill"} 5.0' in text
    assert 'disagg:kv_peer_fetched_bytes_total{instance="p1",role="prefill"} 5.24288e+06' in text
