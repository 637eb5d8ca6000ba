"""The host-memory tier: packed copies of evicted KV blocks in CPU memory, bounded in bytes.

On a GPU this is where a block goes when the device pool needs its room; on CPU the pool is host
memory too, and this is a separate bounded store, so the accounting is the same either way."""

from __future__ import annotations

import torch

from disagg.engine.kv_tiers.lru_bytes import Entry, LRUBytes


class HostTier:
    name = "host"

    def __init__(self, capacity_bytes: int):
        self.blocks = LRUBytes(capacity_bytes)

    def put(self, block_hash: int, tokens: tuple[int, ...], data: torch.Tensor) -> list[tuple[int, Entry]]:
        """Keep a block's KV (moved to the CPU; a CPU tensor is kept as it is: the caller hands
        over a copy of its own); returns the entries dropped for its room."""
        kept = data.to("cpu") if data.device.type != "cpu" else data
        return self.blocks.put(block_hash, Entry(tokens, kept, kept.numel() * kept.element_size()))

    def get(self, block_hash: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        entry = self.blocks.find(block_hash, tokens)
        if entry is None:
            return None
        self.blocks.touch(block_hash)
        return entry.value
