"""The tiers an engine config asks for, built in one place."""

from __future__ import annotations

from disagg.config import EngineConfig
from disagg.engine.kv_cache import KVCache
from disagg.engine.kv_tiers.disk_tier import DiskTier
from disagg.engine.kv_tiers.host_tier import HostTier
from disagg.engine.kv_tiers.index_events import IndexEvents
from disagg.engine.kv_tiers.tiered_store import TieredStore


def build_tiered_store(config: EngineConfig, kv_cache: KVCache) -> TieredStore:
    disk = None
    if config.kv_disk_tier_dir is not None and config.kv_disk_tier_bytes > 0:
        disk = DiskTier(config.kv_disk_tier_dir, config.kv_disk_tier_bytes)
    events = IndexEvents(config.kv_index_max_events)
    return TieredStore(kv_cache, HostTier(config.kv_host_tier_bytes), disk, events)
