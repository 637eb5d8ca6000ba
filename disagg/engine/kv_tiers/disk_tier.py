"""The disk tier: one file per KV block in a directory, bounded in bytes, under the host tier.

File names are the block's chained hash; what the directory held before this process started is
not trusted (removed at start): hashes are only meaningful with the tokens this process kept."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from disagg.engine.kv_tiers.lru_bytes import Entry, LRUBytes


class DiskTier:
    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int):
        self.directory = Path(directory)
        shutil.rmtree(self.directory, ignore_errors=True)
        self.directory.mkdir(parents=True)
        self.blocks = LRUBytes(capacity_bytes)

    def _path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash & (2**64 - 1):016x}.pt"

    def put(self, block_hash: int, tokens: tuple[int, ...], data: torch.Tensor) -> None:
        num_bytes = data.numel() * data.element_size()
        if not self.blocks.fits(num_bytes):
            return
        path = self._path(block_hash)
        torch.save(data.to("cpu"), path)
        for dropped_hash, _ in self.blocks.put(block_hash, Entry(tokens, path, num_bytes)):
            self._path(dropped_hash).unlink(missing_ok=True)

    def get(self, block_hash: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        entry = self.blocks.find(block_hash, tokens)
        if entry is None:
            return None
        self.blocks.touch(block_hash)
        self.blocks.pin(block_hash)  # not dropped while it is read
        try:
            return torch.load(entry.value, weights_only=True)
        finally:
            self.blocks.unpin(block_hash)
