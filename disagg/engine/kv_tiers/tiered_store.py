"""The tiers under one instance's KV pool, as the block manager sees them.

A block the pool's prefix cache evicts goes down (host memory, then disk when the host tier
drops it) instead of being lost; a prompt whose next prefix block is in a tier gets it copied
back into a pool block before the step that reads it (BlockManager.find_cached_prefix). Every
move is also an event for the cluster-wide prefix index (index_events.py).

Copies are synchronous on the engine's thread, between steps: the block manager evicts and
fills only free blocks (reference count 0), which no step and no KV transfer writes."""

from __future__ import annotations

import torch

from disagg.engine.kv_cache import KVCache
from disagg.engine.kv_tiers.disk_tier import DiskTier
from disagg.engine.kv_tiers.host_tier import HostTier
from disagg.engine.kv_tiers.index_events import IndexEvents
from disagg.engine.kv_tiers.tier_stats import TierStats


class TieredStore:
    def __init__(self, kv_cache: KVCache, host: HostTier, disk: DiskTier | None, events: IndexEvents):
        self.kv_cache = kv_cache
        self.host = host
        self.disk = disk
        self.events = events
        self.stats = TierStats()
        self.block_bytes = kv_cache.slice_bytes(
            kv_cache.num_layers, (kv_cache.head_offset, kv_cache.head_offset + kv_cache.num_kv_heads), 1
        )
        # Whether an evicted block is kept anywhere (no tier of room: dropped without a copy).
        self.keeps_blocks = any(tier.blocks.fits(self.block_bytes) for tier in self.tiers)

    @property
    def tiers(self) -> list:
        return [self.host] if self.disk is None else [self.host, self.disk]

    # ---- from the pool's prefix cache ---------------------------------------------------------
    def block_cached(self, block_hash: int) -> None:
        self.events.stored(block_hash, "pool")

    def block_taken(self, num_blocks: int) -> None:
        """A request took `num_blocks` prefix blocks from the pool's cache."""
        self.stats.hit_blocks["pool"] += num_blocks

    def block_evicted(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """The pool reuses `block_id`: its KV goes down a tier before it is overwritten."""
        if self.host.get(block_hash, tokens) is not None:  # came from there: it is there still
            self.events.stored(block_hash, self.host.name)
            return
        if not self.keeps_blocks:
            self._dropped(block_hash, "pool")
            return
        data = self.kv_cache.export_blocks([block_id])
        if not self.host.blocks.fits(self.block_bytes):
            self._down_from_host(block_hash, tokens, data, "pool")
            return
        self.stats.stored_bytes["host"] += self.block_bytes
        self.events.stored(block_hash, self.host.name)
        for dropped_hash, entry in self.host.put(block_hash, tokens, data):
            self._down_from_host(dropped_hash, entry.tokens, entry.value, self.host.name)

    def _down_from_host(self, block_hash: int, tokens: tuple[int, ...], data: torch.Tensor, tier: str) -> None:
        """A block `tier` lets go: to disk where there is one, else gone."""
        if self.disk is not None and self.disk.blocks.fits(data.numel() * data.element_size()):
            before = set(self.disk.blocks.hashes())
            self.disk.put(block_hash, tokens, data)
            self.stats.stored_bytes["disk"] += data.numel() * data.element_size()
            self.events.stored(block_hash, self.disk.name)
            for gone in before - set(self.disk.blocks.hashes()):
                self._dropped(gone, self.disk.name)
            return
        self._dropped(block_hash, tier)

    def _dropped(self, block_hash: int, tier: str) -> None:
        # The index forgets the block only if `tier` is the last it heard of: a block loaded
        # back into the pool is indexed there, and a host copy dropped later does not unlist it.
        self.stats.dropped_blocks += 1
        self.events.dropped(block_hash, tier)

    # ---- back into the pool ------------------------------------------------------------------
    def fetch(self, block_hash: int, tokens: tuple[int, ...]) -> tuple[str, torch.Tensor] | None:
        """(tier, the block's KV) from the highest tier that holds it, or None."""
        for tier in self.tiers:
            data = tier.get(block_hash, tokens)
            if data is not None:
                return tier.name, data
        return None

    def load(self, block_id: int, block_hash: int, fetched: tuple[str, torch.Tensor]) -> None:
        """Copy a fetched block into the pool's `block_id` (free, its old content gone down)."""
        tier, data = fetched
        self.kv_cache.import_blocks([block_id], data)
        self.stats.hit_blocks[tier] += 1
        self.stats.loaded_bytes[tier] += data.numel() * data.element_size()
        self.events.stored(block_hash, "pool")

    # ---- reports -------------------------------------------------------------------------------
    def tier_hashes(self) -> list[tuple[int, str]]:
        """(hash, tier) of every block the tiers hold, the higher tier where both do."""
        held: dict[int, str] = {}
        for tier in reversed(self.tiers):
            held.update(dict.fromkeys(tier.blocks.hashes(), tier.name))
        return list(held.items())

    def report(self) -> dict:
        held_bytes = {t.name: t.blocks.used_bytes for t in self.tiers}
        held_blocks = {t.name: len(t.blocks) for t in self.tiers}
        return self.stats.to_dict(held_bytes, held_blocks)
