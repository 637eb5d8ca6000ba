"""Block-stored and block-dropped events for the cluster-wide prefix index, in a bounded queue.

The engine appends (never blocks, never waits for Redis); a publisher thread drains them in
batches (disagg.worker.prefix_index). When the queue overflows, the oldest events are lost and
`overflowed` says so: the publisher then republishes the whole index instead."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

STORE = "store"  # the block is now held in `tier` (the pool, host or disk)
DROP = "drop"  # `tier` let the block go (the index forgets it unless it names another tier)


@dataclass(frozen=True, slots=True)
class IndexEvent:
    kind: str
    block_hash: int
    tier: str
    at: float  # time.monotonic() when it happened: the index's lag is measured from it


class IndexEvents:
    def __init__(self, max_events: int):
        """`max_events` 0: no index (nothing is kept)."""
        if max_events < 0:
            raise ValueError(f"max_events: must be >= 0, got {max_events}")
        self._events: deque[IndexEvent] = deque()
        self.max_events = max_events
        self.overflowed = False

    def __len__(self) -> int:
        return len(self._events)

    def stored(self, block_hash: int, tier: str) -> None:
        self._append(IndexEvent(STORE, block_hash, tier, time.monotonic()))

    def dropped(self, block_hash: int, tier: str) -> None:
        self._append(IndexEvent(DROP, block_hash, tier, time.monotonic()))

    @property
    def enabled(self) -> bool:
        return self.max_events > 0

    def _append(self, event: IndexEvent) -> None:
        if not self.enabled:
            return
        if len(self._events) >= self.max_events:
            self._events.popleft()
            self.overflowed = True
        self._events.append(event)

    def drain(self, limit: int) -> list[IndexEvent]:
        """Up to `limit` of the oldest events, taken out (safe against the engine appending)."""
        taken = []
        while self._events and len(taken) < limit:
            taken.append(self._events.popleft())
        return taken
