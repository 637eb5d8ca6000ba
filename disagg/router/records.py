"""Soft state written to Redis in batches by a background thread: finished requests' records,
and the arrivals a frontend replica shares with the re-planner (disagg.router.shared_arrivals).

A request then costs the frontend's event loop an append, not a Redis round trip and a thread
hand-off while the next request may be arriving. When Redis is away, or more than `max_pending`
wait, the oldest are dropped, never the requests.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from disagg.errors import RegistryUnavailable
from disagg.registry import Registry

logger = logging.getLogger(__name__)


class BatchedWrites:
    """`write(batch)` every `interval_s` with what was added since, oldest first."""

    def __init__(self, write: Callable[[list], None], what: str, interval_s: float = 1.0, max_pending: int = 10_000):
        self._write = write
        self.what = what
        self.interval_s = interval_s
        self._pending: deque = deque(maxlen=max_pending)  # full: the oldest go first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=what, daemon=True)
        self._thread.start()

    def add(self, item) -> None:
        """Safe from any thread; never blocks."""
        self._pending.append(item)

    def flush(self) -> int:
        """Write what is pending now; the number written (0 when Redis is away: those are dropped)."""
        batch = []
        try:
            while True:
                batch.append(self._pending.popleft())
        except IndexError:  # empty (also when the writer thread and a caller flush at once)
            pass
        if not batch:
            return 0
        try:
            self._write(batch)
        except RegistryUnavailable as exc:
            logger.debug("dropped %d %s: %s", len(batch), self.what, exc)
            return 0
        return len(batch)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the writer after one last flush."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()
        self.flush()


class RequestRecords(BatchedWrites):
    """Finished requests' records (`disagg status`, the bench's tallies)."""

    def __init__(self, registry: Registry, interval_s: float = 1.0, ttl_s: float = 3600, max_pending: int = 10_000):
        self.registry = registry
        super().__init__(
            lambda batch: registry.record_requests(batch, ttl_s), "request-records", interval_s, max_pending
        )
