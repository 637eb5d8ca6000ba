"""A byte-bounded LRU of KV blocks keyed by chained hash, with reference counts.

What a tier stores and in which order it lets go: the least recently used entry that nobody
holds goes first; a pinned entry (its count above zero, being copied) is never dropped.
Pure Python: the values are whatever the tier keeps (a tensor, a file name)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Entry:
    tokens: tuple[int, ...]  # the block's tokens: a lookup is verified against them
    value: object
    num_bytes: int
    ref_count: int = 0


class LRUBytes:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes: must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[int, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def hashes(self) -> list[int]:
        return list(self._entries)

    def find(self, block_hash: int, tokens: tuple[int, ...]) -> Entry | None:
        """The entry of that hash holding exactly those tokens (a collision is a miss)."""
        entry = self._entries.get(block_hash)
        return entry if entry is not None and entry.tokens == tokens else None

    def touch(self, block_hash: int) -> None:
        self._entries.move_to_end(block_hash)

    def fits(self, num_bytes: int) -> bool:
        """Whether an entry that large can ever be kept (not larger than the whole tier)."""
        return num_bytes <= self.capacity_bytes

    def put(self, block_hash: int, entry: Entry) -> list[tuple[int, Entry]]:
        """Keep the entry as the most recent; returns those dropped to make room (oldest first)."""
        old = self._entries.pop(block_hash, None)
        if old is not None:
            self.used_bytes -= old.num_bytes
        dropped = self._make_room(entry.num_bytes)
        self._entries[block_hash] = entry
        self.used_bytes += entry.num_bytes
        return dropped

    def pop(self, block_hash: int) -> Entry:
        entry = self._entries.pop(block_hash)
        self.used_bytes -= entry.num_bytes
        return entry

    def pin(self, block_hash: int) -> None:
        self._entries[block_hash].ref_count += 1

    def unpin(self, block_hash: int) -> None:
        self._entries[block_hash].ref_count -= 1

    def _make_room(self, num_bytes: int) -> list[tuple[int, Entry]]:
        dropped = []
        for block_hash in list(self._entries):
            if self.used_bytes + num_bytes <= self.capacity_bytes:
                break
            if self._entries[block_hash].ref_count == 0:
                dropped.append((block_hash, self.pop(block_hash)))
        return dropped
