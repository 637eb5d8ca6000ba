"""A worker's publisher of its prefix blocks to the cluster-wide index (disagg.prefix_index).

The engine only appends events to a bounded queue (kv_tiers.index_events); this thread drains
them in batches every interval, so a slow or absent Redis never holds a step. Whenever the index
in Redis may be incomplete (events lost to a failure or an overflow, Redis restarted empty,
the role switched), it writes the whole index again from what the engine holds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from disagg.engine.engine import LLMEngine
from disagg.errors import RegistryUnavailable
from disagg.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)
MAX_BATCH_EVENTS = 20_000  # per Redis round trip


def held_blocks(engine: LLMEngine) -> dict[int, str]:
    """Block hash -> tier of every block the engine holds (the pool over a lower tier).
    Read from another thread: RuntimeError if the engine changed them meanwhile."""
    entries = dict(engine.kv_tiers.tier_hashes())
    bm = engine.block_manager
    entries.update(dict.fromkeys(bm.cached_hashes(bm.num_total_blocks), "pool"))
    return entries


class PrefixPublisher:
    def __init__(
        self,
        registry_url: str | None,
        instance_id: str,
        engine: Callable[[], LLMEngine],
        interval_s: float,
        ttl_s: float,
    ):
        """`engine`: the worker's engine now (read each time). No `registry_url`: nothing runs."""
        self.registry_url = registry_url
        self.instance_id = instance_id
        self._engine = engine
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._stopping = threading.Event()
        self._complete = False  # the index in Redis is this instance's whole index
        self.lag_s = 0.0  # the oldest event of the latest batch: how long it waited
        self.num_republished = 0

    def start(self) -> None:
        if self.registry_url:
            threading.Thread(target=self._run, name=f"prefix-index-{self.instance_id}", daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()

    def mark_incomplete(self) -> None:
        """What Redis holds no longer matches (a role switch emptied the pool): write it anew."""
        self._complete = False

    def report(self) -> dict:
        return {"lag_s": round(self.lag_s, 4), "republished": self.num_republished, "complete": self._complete}

    def _run(self) -> None:
        index = PrefixIndex(self.registry_url)
        while not self._stopping.wait(self.interval_s):
            self.publish_once(index)
        index.close()

    def publish_once(self, index: PrefixIndex) -> None:
        engine = self._engine()
        if engine.kv_tiers is None or not engine.kv_tiers.events.enabled:
            return
        try:
            if not self._complete or engine.kv_tiers.events.overflowed:
                self._republish(index, engine)
            else:
                self._publish_events(index, engine)
        except RegistryUnavailable as exc:  # its events are lost: the whole index goes again later
            self._complete = False
            logger.debug("prefix index not published: %s", exc)
        except RuntimeError:  # the engine changed what it holds while it was read: next time
            self._complete = False

    def _publish_events(self, index: PrefixIndex, engine: LLMEngine) -> None:
        events = engine.kv_tiers.events.drain(MAX_BATCH_EVENTS)
        self.lag_s = time.monotonic() - events[0].at if events else 0.0
        self._complete = False  # until Redis confirms it applied them to a complete index
        if index.apply(self.instance_id, [(e.kind, e.block_hash, e.tier) for e in events], self.ttl_s):
            self._complete = True
        else:  # Redis lost it (restarted empty): all of it again
            self._republish(index, engine)

    def _republish(self, index: PrefixIndex, engine: LLMEngine) -> None:
        events = engine.kv_tiers.events
        events.overflowed = False
        events.drain(len(events))  # what the snapshot below already holds
        index.republish(self.instance_id, held_blocks(engine), self.ttl_s)
        self._complete = True
        self.num_republished += 1
