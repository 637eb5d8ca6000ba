"""The router's side of peer block fetch (disagg.kv_transfer.peer_blocks): before a prompt goes
to its prefill instance, the blocks of its prefix that the instance lacks and another holds (by
the cluster-wide prefix index) are fetched there, when the rule of disagg.placement.peer_fetch
predicts that faster than computing them.

Three calls, in order: the holder's export layout (asked once per instance and kept), a slot on
the prefill instance, then the holder's send into it, which answers once the blocks are in. The
whole fetch has `timeout_s`; whatever goes wrong (a stale index entry, a dead holder, no room, a
timeout) the prompt goes to its prefill instance as it would have, and computes what is missing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from disagg.config import ServingConfig
from disagg.kv_transfer.layout import KVLayout
from disagg.placement.peer_fetch import FetchPlan, FetchRate, plan_fetch
from disagg.router.directory import Instance, InstanceDirectory

logger = logging.getLogger(__name__)
FETCH_SUFFIX = "~fetch"  # a fetch's id on both instances: its request's, so that nothing else has it
ABORT_TIMEOUT_S = 5.0
_EXPORT_LAYOUT = "peer_export_layout"  # Instance.extra's key of the holder's export layout
HOLDER_ROLES = ("prefill", "decode")


class PeerFetch:
    def __init__(
        self,
        directory: InstanceDirectory,
        block_size: int,
        block_bytes: int,
        rate: FetchRate,
        timeout_s: float,
        on_fetched: Callable[[int], None] | None = None,
    ):
        """`block_bytes`: a KV block's bytes on an instance (every layer and head); `on_fetched`:
        told the blocks of each fetch that succeeded."""
        self.directory = directory
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.rate = rate
        self.timeout_s = timeout_s
        self.on_fetched = on_fetched
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    def from_config(
        cls, config: ServingConfig, directory: InstanceDirectory, kv_bytes_per_token: int
    ) -> PeerFetch | None:
        """None where it is off (`peer_fetch`, or a colocated deployment, which has no prefill pool)."""
        if not config.peer_fetch or config.mode != "disaggregated":
            return None
        rate = FetchRate(config.peer_fetch_gb_s * 1e9, config.peer_fetch_latency_ms)
        block_size = config.engine.block_size
        return cls(directory, block_size, kv_bytes_per_token * block_size, rate, config.peer_fetch_timeout_s)

    def plan(self, prefill: Instance, block_hashes: Sequence[int], prompt_tokens: int) -> FetchPlan | None:
        """What the rule says for this prompt on `prefill`: from whom, how many blocks (None: no fetch)."""
        if not _one_rank(prefill):  # an instance of several ranks fetches nothing (yet)
            return None
        holders = [i for i in self.directory.all() if i is not prefill and self._may_lend(i)]
        return plan_fetch(prefill, prefill.step_model, holders, block_hashes, prompt_tokens, self.block_size,
                          self.block_bytes, self.rate)  # fmt: skip

    def _may_lend(self, instance: Instance) -> bool:
        """A live one-rank prefill or decode instance, unless it said it lends nothing."""
        said_none = _EXPORT_LAYOUT in instance.extra and instance.extra[_EXPORT_LAYOUT] is None
        return (
            instance.role in HOLDER_ROLES
            and _one_rank(instance)
            and not said_none
            and not self.directory.is_failed(instance)
        )

    async def fetch(self, request_id: str, token_ids: list[int], block_hashes: Sequence[int], prefill: Instance) -> int:
        """Fetch what the plan says into `prefill` before its prompt goes there; the prompt's
        tokens it holds in its prefix cache by the fetch (0: none fetched, whatever the reason)."""
        plan = self.plan(prefill, block_hashes, len(token_ids))
        if plan is None:
            return 0
        fetch_id = request_id + FETCH_SUFFIX
        prefix = list(token_ids[: plan.num_blocks * self.block_size])
        try:
            done = await asyncio.wait_for(self._fetch(fetch_id, prefix, plan, prefill), self.timeout_s)
        except asyncio.CancelledError:  # its request ended meanwhile
            self._abandon(fetch_id, prefill, plan.holder)
            raise
        except Exception as exc:  # a dead holder, a broken link, a timeout: the prefill computes the blocks
            logger.info("peer fetch for %s from %s failed: %s", request_id, plan.holder.instance_id, exc)
            done = False
        if not done:
            self._abandon(fetch_id, prefill, plan.holder)
            self._forget(plan.holder, block_hashes[plan.own_blocks : plan.num_blocks])
            return 0
        if self.on_fetched is not None:
            self.on_fetched(plan.extra_blocks)
        return plan.num_blocks * self.block_size

    async def _fetch(self, fetch_id: str, prefix: list[int], plan: FetchPlan, prefill: Instance) -> bool:
        holder = plan.holder
        source = await self._export_layout(holder)
        if source is None:
            return False
        slot = await prefill.peer_service.reserve_peer_import(
            fetch_id, prefix, plan.num_blocks, source, timeout_s=self.timeout_s
        )
        if slot is None:  # it lacks nothing by now, or has no room
            return False
        return await holder.peer_service.export_prefix(
            fetch_id, prefix, plan.num_blocks, slot, timeout_s=self.timeout_s
        )

    async def _export_layout(self, holder: Instance) -> KVLayout | None:
        """The holder's export layout, asked once (an instance back at a new address is a new Instance)."""
        if _EXPORT_LAYOUT not in holder.extra:
            holder.extra[_EXPORT_LAYOUT] = await holder.peer_service.peer_export_layout(timeout_s=self.timeout_s)
        return holder.extra[_EXPORT_LAYOUT]

    @staticmethod
    def _forget(holder: Instance, block_hashes: Sequence[int]) -> None:
        """What it did not lend is taken as not there until its next report or index read says
        otherwise: the next requests do not ask again."""
        holder.prefix_hashes.difference_update(block_hashes)
        holder.indexed_hashes.difference_update(block_hashes)

    def _abandon(self, fetch_id: str, prefill: Instance, holder: Instance) -> None:
        """Both sides drop the fetch (its slot's blocks, its pinned ones) now, not at their timeout;
        sent now, awaited in the background."""
        aborts = [
            instance.peer_service.abort(fetch_id, timeout_s=ABORT_TIMEOUT_S)
            for instance in (prefill, holder)
            if not self.directory.is_failed(instance)
        ]
        if aborts:
            task = asyncio.ensure_future(asyncio.gather(*aborts, return_exceptions=True))
            self._tasks.add(task)  # a reference until it ends (the loop keeps only weak ones)
            task.add_done_callback(self._tasks.discard)


def _one_rank(instance: Instance) -> bool:
    return len(instance.kv_layout.ranks) == 1
