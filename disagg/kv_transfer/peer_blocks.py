"""Peer block fetch: a prefill instance that misses a prompt's prefix takes the cached blocks
from another instance that holds them (a decode instance holding a conversation's history,
another prefill instance) instead of computing them again.

Two halves, each on its instance's engine thread and each with a KV endpoint of its own (its own
transport, so they never share a pair with the request path's transfers):

- `PeerImports` (the fetching prefill instance): `reserve` takes blocks for the prefix, those
  the pool holds already and fresh ones for the rest, and has its receiver expect the rest
  from the holder's exports. Once they are in, `settle` registers them in the prefix cache
  under their hashes, so the prompt's prefill hits them; a failure gives the blocks back.
- `PeerExports` (the holder, any one-rank prefill or decode instance): `start` finds the
  prefix in the pool's prefix cache by its hashes (verified against the tokens; blocks only a
  tier under the pool holds are loaded back first), pins the blocks (reference counts) and
  sends those the importer lacks: by reference on one host
  when the cache is in shared memory, packed otherwise, as the request path's sender does. The
  answer (a Future) is True once the importer acknowledged them, False when the pool no longer
  holds the prefix (a stale index entry) or the transfer failed. The blocks are unpinned on the
  acknowledgement; after a failure or an abort only once the transfer's timeout has passed: a
  reference to them may still be in the importer's hands until then (messages.BlockRef).

Every wait has the endpoints' timeout, and at most `max_active` of each run at once: a fetch
that cannot happen costs its request the recompute it would have been, never an error.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from disagg.engine.block_manager import PLACEHOLDER
from disagg.engine.engine import LLMEngine
from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVLayout, KVTarget
from disagg.kv_transfer.receiver import KVReceiver
from disagg.kv_transfer.sender import KVSender

logger = logging.getLogger(__name__)
MAX_ACTIVE = 8  # fetches under way at once on one side; more are refused (their prefill recomputes)


@dataclass(frozen=True)
class ImportSlot:
    """Where a fetched prefix goes: the receiver's transfer id and its block table (the blocks
    the pool held already are placeholders: nobody sends them)."""

    transfer_id: int
    block_ids: list[int]


@dataclass
class _Import:
    token_ids: list[int]
    table: list[int]  # every block of the prefix, taken
    num_fetched: int  # its last blocks, the ones that come from the peer


@dataclass
class _Export:
    blocks: list[int]  # pinned
    done: Future = field(default_factory=Future)


class PeerImports:
    """The fetching side (engine thread only)."""

    def __init__(self, engine: LLMEngine, receiver: KVReceiver, max_active: int = MAX_ACTIVE):
        receiver.register_kv_cache(engine.kv_cache)
        self.engine = engine
        self.receiver = receiver
        self.max_active = max_active
        self._imports: dict[str, _Import] = {}
        self.fetched_blocks = 0  # blocks registered from peers so far, and their bytes
        self.fetched_bytes = 0

    def layout(self) -> KVLayout:
        return KVLayout.single(self.receiver.worker_id, self.receiver.address())

    @property
    def active(self) -> bool:
        return bool(self._imports)

    def has_news(self) -> bool:
        return bool(self._imports) and self.receiver.has_finished()

    def reserve(self, import_id: str, token_ids: list[int], num_blocks: int, source: KVLayout) -> ImportSlot | None:
        """Blocks for the first `num_blocks` full blocks of `token_ids`, the missing ones to come
        from `source` (the holder's exports); None when none is missing, there is no room, or
        too many fetches are under way."""
        if import_id in self._imports or len(self._imports) >= self.max_active:
            return None
        reserved = self.engine.block_manager.reserve_prefix_import(token_ids, num_blocks)
        if reserved is None:
            return None
        held, table = reserved
        targets = [PLACEHOLDER] * held + table[held:]
        sources = {rank.peer_id: rank.address for rank in source.ranks}
        transfer_id = self.receiver.expect(import_id, targets, sources)
        prefix = list(token_ids[: num_blocks * self.engine.kv_cache.block_size])
        self._imports[import_id] = _Import(prefix, table, num_blocks - held)
        return ImportSlot(transfer_id, targets)

    def settle(self) -> None:
        """Imports that ended: in the prefix cache if whole, given back otherwise."""
        if not self._imports:
            return
        for result in self.receiver.poll():
            entry = self._imports.pop(result.request_id, None)
            if entry is not None:
                self._end(result, entry)

    def _end(self, result: TransferResult, entry: _Import) -> None:
        if not result.ok:
            logger.info("peer fetch %s failed (its prefill computes the blocks): %s", result.request_id, result.error)
            self.engine.block_manager.unpin(entry.table)
            return
        self.engine.block_manager.finish_prefix_import(entry.token_ids, entry.table)
        self.fetched_blocks += entry.num_fetched
        self.fetched_bytes += result.num_bytes

    def abort(self, import_id: str) -> None:
        entry = self._imports.pop(import_id, None)
        if entry is not None:
            self.receiver.abort(import_id)  # before the blocks go back: no late write lands in them
            self.engine.block_manager.unpin(entry.table)

    def report(self) -> dict:
        return {"fetched_blocks": self.fetched_blocks, "fetched_bytes": self.fetched_bytes}

    def close(self) -> None:
        self.receiver.close()


class PeerExports:
    """The holder's side (engine thread only, except the futures)."""

    def __init__(self, engine: LLMEngine, sender: KVSender, max_active: int = MAX_ACTIVE):
        sender.register_kv_cache(engine.kv_cache)
        self.engine = engine
        self.sender = sender
        self.max_active = max_active
        self._exports: dict[str, _Export] = {}
        self._lingering: list[tuple[float, list[int]]] = []  # (unpin at, blocks) of failed exports

    def layout(self) -> KVLayout:
        return KVLayout.single(self.sender.worker_id, self.sender.address())

    @property
    def active(self) -> bool:
        return bool(self._exports or self._lingering)

    def has_news(self) -> bool:
        due = bool(self._lingering) and time.monotonic() >= self._lingering[0][0]
        return due or (bool(self._exports) and self.sender.has_finished())

    def start(self, export_id: str, token_ids: list[int], num_blocks: int, target: KVTarget) -> Future:
        """Send the first `num_blocks` full blocks of `token_ids` into `target` (the importer's
        slot: its placeholders are not sent). The Future: True once acknowledged; False at once
        when the pool does not hold them all (or too many exports are under way or lingering)."""
        blocks = None
        if export_id not in self._exports and len(self._exports) + len(self._lingering) < self.max_active:
            blocks = self.engine.block_manager.pin_cached_prefix(token_ids, num_blocks)
        if blocks is None:
            answer: Future = Future()
            answer.set_result(False)
            return answer
        export = self._exports[export_id] = _Export(blocks)
        self.sender.add(export_id, [target])
        self.sender.catch_up(export_id, blocks, num_blocks * self.engine.kv_cache.block_size)
        self.sender.finish(export_id, -1)  # no token: a DONE that only closes the transfer
        return export.done

    def settle(self) -> None:
        """Exports that ended (acknowledged, failed or timed out): their blocks unpinned (a
        failed one's once its timeout has passed)."""
        now = time.monotonic()
        while self._lingering and now >= self._lingering[0][0]:
            self.engine.block_manager.unpin(self._lingering.pop(0)[1])
        if not self._exports:
            return
        for result in self.sender.poll():
            export = self._exports.pop(result.request_id, None)
            if export is not None:
                self._end(export, result.ok, result.error)

    def abort(self, export_id: str) -> None:
        export = self._exports.pop(export_id, None)
        if export is not None:
            self.sender.abort(export_id)
            self._end(export, False, "aborted")

    def _end(self, export: _Export, ok: bool, error: str | None) -> None:
        if ok:
            self.engine.block_manager.unpin(export.blocks)
        else:
            logger.info("peer export failed: %s", error)
            self._lingering.append((time.monotonic() + self.sender.timeout, export.blocks))
        if not export.done.done():
            export.done.set_result(ok)

    def close(self) -> None:
        for export_id in list(self._exports):
            self.abort(export_id)
        self.sender.close()


def export_target(slot_layout: KVLayout, transfer_id: int, block_ids: list[int], num_layers: int,
                  num_kv_heads: int) -> KVTarget:  # fmt: skip
    """The importer's slot as a sender's target: every layer and head of a one-rank instance."""
    rank = slot_layout.ranks[0]
    return KVTarget(rank.peer_id, rank.address, transfer_id, list(block_ids), (0, num_layers), (0, num_kv_heads))


class PeerBlocks:
    """An instance's two halves, either of which may be missing (an instance of several ranks
    has neither; only a prefill instance imports). Engine thread only."""

    def __init__(self, engine: LLMEngine, exports: PeerExports | None = None, imports: PeerImports | None = None):
        self.engine = engine
        self.exports = exports
        self.imports = imports

    @classmethod
    def build(
        cls, engine: LLMEngine, export_transport=None, import_transport=None, *, kv_timeout: float, wake=None
    ) -> PeerBlocks:
        """The halves whose transport is given, their endpoints waking the engine loop (`wake`)."""
        exports = imports = None
        if export_transport is not None:
            exports = PeerExports(engine, KVSender(export_transport, timeout=kv_timeout, wake=wake))
        if import_transport is not None:
            receiver = KVReceiver(
                import_transport, timeout=kv_timeout, attention_backend=engine.config.attention_backend, wake=wake
            )
            imports = PeerImports(engine, receiver)
        return cls(engine, exports, imports)

    def _halves(self) -> list:
        return [half for half in (self.exports, self.imports) if half is not None]

    def export_layout(self) -> KVLayout | None:
        """Where this instance's exports come from (None: it lends no blocks)."""
        return self.exports.layout() if self.exports is not None else None

    def export(self, export_id: str, token_ids: list[int], num_blocks: int, slot_layout: KVLayout,
               transfer_id: int, block_ids: list[int]) -> Future:  # fmt: skip
        """PeerExports.start into the importer's slot (False at once: this instance lends none)."""
        if self.exports is None:
            answer: Future = Future()
            answer.set_result(False)
            return answer
        cfg = self.engine.model_config
        target = export_target(slot_layout, transfer_id, block_ids, cfg.num_hidden_layers, cfg.num_key_value_heads)
        return self.exports.start(export_id, token_ids, num_blocks, target)

    @property
    def active(self) -> bool:
        return any(half.active for half in self._halves())

    def has_news(self) -> bool:
        return any(half.has_news() for half in self._halves())

    def settle(self) -> None:
        for half in self._halves():
            half.settle()

    def abort(self, fetch_id: str) -> None:
        for half in self._halves():
            half.abort(fetch_id)

    def report(self) -> dict:
        """What `disagg status` and the metrics show (empty: this instance fetches nothing)."""
        return self.imports.report() if self.imports is not None else {}

    def close(self) -> None:
        for half in self._halves():
            half.close()
