"""Moving decoding requests between decode instances with their KV (live migration), so that an
instance can leave (SIGTERM, scale-in, a role switch) without any request recomputing its
context, and a loaded one can hand work to another (`rebalance`: a batch predicted to miss its
TPOT target hands requests to an instance with room, disagg.placement.rebalance).

One move (disagg.decode_worker.migration does the workers' half): the target reserves blocks
for the tokens known now plus room; the source pre-copies the KV while the request decodes on,
pauses it at a step boundary, sends the rest with the request's tokens, and answers the router
with those tokens; the target decodes on, and the router hands the stream over once every token
the source produced has reached it. The client sees one stream: no token repeated or missing, greedy and seeded output unchanged.
A move that fails leaves the request decoding where it was; a source that dies during one
fails its requests into the ordinary recompute migration (disagg.router.migration).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from disagg.errors import RemoteError, WorkerLinkError
from disagg.placement.rebalance import rebalance
from disagg.router.directory import Instance, InstanceDirectory
from disagg.router.orchestrator import Handover, Orchestrator, Placement

logger = logging.getLogger(__name__)
HEADROOM_TOKENS = 64  # positions a target reserves beyond the known tokens (the source decodes on meanwhile)


@dataclass
class MoveStats:
    moved: int = 0
    failed: int = 0


class LiveMoves:
    def __init__(self, orchestrator: Orchestrator, directory: InstanceDirectory):
        self.orchestrator = orchestrator
        self.directory = directory
        self.stats = MoveStats()

    def requests_on(self, instance: Instance) -> list[Placement]:
        return [
            p
            for p in self.orchestrator.live.values()
            if p.decode is instance and p.handover is None and p.moving_to is None and p.num_tokens > 0
        ]

    async def drain(self, instance: Instance) -> MoveStats:
        """Move every request decoding on `instance` to the other decode instances (chosen as the
        placement policy would for a new request), until none is left or the config's
        drain_timeout_s passed (the instance leaves then)."""
        stats = MoveStats()
        deadline = time.monotonic() + self.orchestrator.config.drain_timeout_s
        while time.monotonic() < deadline and (placements := self.requests_on(instance)):
            results = await asyncio.gather(*(self._move_elsewhere(p, instance) for p in placements))
            stats.moved += sum(results)
            stats.failed += len(results) - sum(results)
            if not any(results):
                await asyncio.sleep(0.2)  # no room anywhere now: try again shortly
        return stats

    async def rebalance(self, tpot_ms: float) -> MoveStats:
        """One round of disagg.placement.rebalance on the decode instances in placement: requests
        of a batch predicted to miss `tpot_ms` move to an instance with room."""
        plan = rebalance(self.directory.healthy("decode"), self.requests_on, lambda p: len(p.token_ids), tpot_ms)
        results = await asyncio.gather(*(self.move(m.request, m.target) for m in plan))
        return MoveStats(sum(results), len(results) - sum(results))

    async def _move_elsewhere(self, placement: Placement, source: Instance) -> bool:
        candidates = [i for i in self.directory.healthy("decode") if i is not source]  # (draining ones are not healthy)
        num_tokens = len(placement.token_ids)  # (the last one's KV comes later: `move` reserves for the others')
        blocks = self.orchestrator.blocks_reserved(num_tokens + HEADROOM_TOKENS, num_tokens - 1)
        target = self.orchestrator.policy.choose_decode(candidates, blocks) if candidates else None
        return target is not None and await self.move(placement, target)

    async def move(self, placement: Placement, target: Instance) -> bool:
        """Move one decoding request to `target`; False (the request decodes on where it was) when
        it cannot move."""
        source, request_id, params = placement.decode, placement.request_id, placement.params
        known = placement.token_ids[:-1]  # the last token's KV may not be computed yet
        capacity = min(len(known) + HEADROOM_TOKENS, placement.num_prompt_tokens + params.max_tokens)
        try:
            layout = await self._migration_layout(source)
            if layout is None:
                return False
            reservation = await target.decode_service.reserve_migration(
                request_id, known, params, placement.num_prompt_tokens, layout, capacity,
                self.orchestrator.config.kv_timeout_s, placement.priority, timeout_s=self._timeout_s,
            )  # fmt: skip
        except (WorkerLinkError, RemoteError, asyncio.TimeoutError) as exc:
            logger.warning("move of %s: no reservation on %s: %s", request_id, target.instance_id, exc)
            return self._failed()
        if reservation is None:
            return self._failed()
        placement.moving_to = target
        mailbox = self.orchestrator.streams.open(target.instance_id, request_id)  # before it can stream anything
        try:
            tokens = await source.decode_service.migrate_out(request_id, reservation, timeout_s=self._timeout_s)
        except (WorkerLinkError, RemoteError, asyncio.TimeoutError) as exc:
            logger.warning("move of %s from %s failed: %s", request_id, source.instance_id, exc)
            await self._release_target(placement, target)
            return self._failed()
        if self.orchestrator.live.get(request_id) is not placement:
            return self._failed()  # it ended meanwhile (its end aborted the target too)
        target.admit(placement.num_prompt_tokens)
        placement.handover = Handover(target, mailbox, len(tokens) - placement.num_prompt_tokens)
        placement.mailbox.wake()  # its stream may hand over at once
        self.stats.moved += 1
        return True

    async def _migration_layout(self, source: Instance):
        """Where the source's moving KV comes from; asked once per process of it (a relaunched
        worker listens elsewhere: its request link's address changes too)."""
        key = ("migration_layout", source.view.info.rpc_address)
        if key not in source.extra:
            source.extra[key] = await source.decode_service.migration_layout(timeout_s=self._timeout_s)
        return source.extra[key]

    async def _release_target(self, placement: Placement, target: Instance) -> None:
        placement.moving_to = None
        self.orchestrator.streams.close(target.instance_id, placement.request_id)
        try:
            await target.decode_service.abort(placement.request_id, timeout_s=self._timeout_s)
        except (WorkerLinkError, RemoteError, asyncio.TimeoutError):
            pass  # its reservation expires with the KV timeout

    @property
    def _timeout_s(self) -> float:
        return self.orchestrator.config.control_call_timeout_s

    def _failed(self) -> bool:
        self.stats.failed += 1
        return False
