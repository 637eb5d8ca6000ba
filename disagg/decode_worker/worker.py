"""A decode instance: an engine in the DECODE role that takes KV from prefill workers.

Plain Python; the Ray actor wraps it. `reserve` is the handshake: blocks for the prompt are
allocated now and their ids returned, and every rank's receiver starts listening to the
prefill ranks that hold its slice.
When the KV and the first token are in, the request joins the decode batch.

The same worker without a transport (COLOCATED role) runs whole requests itself with chunked
prefill: the baseline that disaggregation is measured against.

With a second transport (`migration_transport`) a decoding request can move to another decode
instance with its KV, and requests can arrive from others that way (disagg.decode_worker.migration).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.config import EngineConfig, Role
from disagg.decode_worker.migration import MigrationSource, MigrationTarget, Outgoing
from disagg.engine.distributed import InstanceGroups
from disagg.engine.engine import LLMEngine
from disagg.engine.outputs import RequestOutput
from disagg.kv_transfer.connector import assemble, instance_kv_layout
from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVLayout, sources_for, targets_for
from disagg.kv_transfer.sender import KVSender
from disagg.kv_transfer.tally import TransferTally
from disagg.kv_transfer.transport import Transport
from disagg.request import SamplingParams
from disagg.rpc.messages import Reservation
from disagg.worker.shard_group import ShardGroup


@dataclass(frozen=True)
class FailedRequest:
    request_id: str
    error: str


class DecodeWorker:
    def __init__(
        self,
        config: EngineConfig,
        transport: Transport | None,
        *,
        kv_timeout: float,
        groups: InstanceGroups | None = None,
        followers: ShardGroup | None = None,
        migration_transport: Transport | None = None,
        engine: LLMEngine | None = None,
    ):
        """Without a transport: the COLOCATED role. `groups`, `followers`: rank 0 of a TP x PP
        instance (its process groups, the other ranks). `migration_transport`: what moving
        requests out goes over (None: they cannot move out; one rank only). `engine`: an idle
        engine to take over, switched to this role (disagg.worker.role_switch)."""
        role = Role.DECODE if transport is not None else Role.COLOCATED
        built = assemble(
            config, role, kv_timeout=kv_timeout, transport=transport, groups=groups, followers=followers, engine=engine
        )
        self.engine, self.receiver = built.engine, built.endpoint
        self.migrations_out: MigrationSource | None = None
        if migration_transport is not None:
            if followers is not None:
                raise ValueError("migration: an instance of several ranks cannot move requests yet")
            sender = KVSender(migration_transport, timeout=kv_timeout)
            sender.register_kv_cache(self.engine.kv_cache)
            self.migrations_out = MigrationSource(self.engine, sender)
        self.migrations_in = MigrationTarget(self.engine)
        self.followers = followers
        self.tally = TransferTally()  # a request's KV is in when every rank's slice is
        self.failed: list[FailedRequest] = []  # the latest step's transfer failures
        self.transfer_results: list[TransferResult] = []
        self._layout: KVLayout | None = None

    def address(self) -> str:
        return self.receiver.address() if self.receiver is not None else ""

    def kv_layout(self) -> KVLayout | None:
        """Every rank's KV endpoint (None: colocated); fixed once the other ranks joined."""
        if self._layout is None:
            self._layout = instance_kv_layout(
                self.engine.config, self.receiver, self.followers.kv_ranks if self.followers is not None else []
            )
        return self._layout

    def migration_layout(self) -> KVLayout:
        """Where requests moving out of here send their KV from (a target's `reserve_migration`)."""
        if self.migrations_out is None:
            raise ValueError("migration: this worker has no migration transport")
        sender = self.migrations_out.sender
        return KVLayout.single(sender.worker_id, sender.address())

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, priority: int = 0
    ) -> None:
        """Run the whole request here: the COLOCATED role, or a short prompt the router chose to
        prefill on this DECODE instance (conditional disaggregation) as a chunk of its steps."""
        self.engine.add_request(
            request_id, prompt_token_ids=prompt_token_ids, sampling_params=sampling_params, priority=priority
        )

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        prefill: KVLayout,
        kv_wait_s: float | None = None,
        priority: int = 0,
    ) -> Reservation | None:
        """The handshake with the prefill instance whose ranks are `prefill` (any parallel plan):
        pre-allocate the prompt's blocks and have every rank of this instance listen to the
        prefill ranks that hold its slice of the KV; None when there is no room now. The first
        KV must arrive within `kv_wait_s` (None: the kv timeout), and each later arrival within
        the kv timeout of the one before, else the request fails."""
        block_ids = self.engine.reserve_for_remote_prefill(
            request_id, prompt_token_ids, sampling_params, priority=priority
        )
        if block_ids is None:
            return None
        cfg, layout = self.engine.model_config, self.kv_layout()
        transfer_ids = {}
        for index, rank in enumerate(layout.ranks):
            sources = sources_for(rank.place, prefill, layout.plan, cfg.num_hidden_layers, cfg.num_key_value_heads)
            if index == 0:
                transfer_ids[rank.peer_id] = self.receiver.expect(request_id, block_ids, sources, kv_wait_s)
            else:
                transfer_ids[rank.peer_id] = self.followers.expect(index - 1, request_id, block_ids, sources, kv_wait_s)
        self.tally.expect(request_id, len(layout.ranks))
        return Reservation(transfer_ids[layout.ranks[0].peer_id], block_ids, transfer_ids, layout)

    # ---- live migration (engine thread) ----------------------------------------------------------
    def reserve_migration(
        self,
        request_id: str,
        token_ids: list[int],
        sampling_params: SamplingParams,
        num_prompt_tokens: int,
        source: KVLayout,
        capacity_tokens: int,
        kv_wait_s: float | None = None,
        priority: int = 0,
    ) -> Reservation | None:
        """Room for a request moving here from the instance whose migration senders are `source`:
        its attempt (`sampling_params`, a prompt of `num_prompt_tokens`, `priority`) has `token_ids`
        with KV now; up to `capacity_tokens` positions. None when there is no room."""
        if self.receiver is None or self.followers is not None:
            raise ValueError("migration: only a one-rank DECODE instance takes moving requests")
        block_ids = self.migrations_in.reserve(
            request_id, token_ids, sampling_params, num_prompt_tokens, capacity_tokens, priority
        )
        if block_ids is None:
            return None
        rank = self.kv_layout().ranks[0]
        sources = {p.peer_id: p.address for p in source.ranks}
        transfer_id = self.receiver.expect(request_id, block_ids, sources, kv_wait_s)
        self.tally.expect(request_id, 1)
        return Reservation(transfer_id, block_ids, {rank.peer_id: transfer_id}, self.kv_layout())

    def migrate_out(self, request_id: str, reservation: Reservation) -> Outgoing:
        """Start moving a decoding request into another instance's reservation. The returned
        move's `paused` future gives the request's tokens at its pause (the target gets them with
        the KV); `done` says whether it runs there now or went on here."""
        if self.migrations_out is None:
            raise ValueError("migration: this worker has no migration transport")
        cfg = self.engine.model_config
        targets = targets_for(
            (0, 0),
            self.migration_layout().plan,
            reservation.layout,
            reservation.transfer_ids,
            reservation.block_ids,
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
        )
        return self.migrations_out.start(request_id, targets)

    def abort(self, request_id: str) -> bool:
        if self.migrations_out is not None:
            self.migrations_out.abort(request_id)
        self.migrations_in.forget(request_id)
        if self.receiver is not None:  # before the blocks are freed: no late write lands in them
            self.receiver.abort(request_id)
            if self.followers is not None:
                self.followers.abort_transfers(request_id)
            self.tally.forget(request_id)
        return self.engine.abort_request(request_id)

    def needs_sync(self) -> bool:
        """The other ranks hold transfers still under way, a move out ended, or a request that
        moved here can join the batch: a step is due."""
        moved_out = self.migrations_out is not None and self.migrations_out.sender.has_finished()
        return moved_out or self.migrations_in.has_ready() or (self.followers is not None and self.tally.has_pending)

    def step(self) -> list[RequestOutput]:
        """Admit requests whose KV arrived (their first-token output comes first), then decode."""
        outputs = []
        self.failed = []
        if self.migrations_out is not None:
            self.migrations_out.before_step()  # pre-copies that are over pause here
        self.transfer_results = self._finished_transfers()
        for result in self.transfer_results:
            if result.ok and result.request_id in self.migrations_in:
                self.migrations_in.kv_arrived(result)
            elif result.ok:
                outputs.append(self.engine.finish_kv_import(result.request_id, result.first_token))
            else:
                self.migrations_in.forget(result.request_id)
                self.engine.abort_request(result.request_id)
                self.failed.append(FailedRequest(result.request_id, result.error or "KV transfer failed"))
        arrived, broken = self.migrations_in.ready()
        outputs.extend(arrived)
        self.failed.extend(FailedRequest(request_id, error) for request_id, error in broken)
        outputs.extend(self.engine.step())
        if self.migrations_out is not None:
            self.migrations_out.after_step()  # moves that ended: freed here, or resumed
        return outputs

    def _finished_transfers(self) -> list[TransferResult]:
        if self.receiver is None:
            return []
        results = self.receiver.poll()
        if self.followers is not None:
            if self.tally.has_pending and not self.engine.scheduler.running:
                self.followers.sync()  # no step will bring their news: ask
            results += self.followers.take_results()
        return self.tally.add(results)

    def is_idle(self) -> bool:
        moving = self.migrations_out is not None and self.migrations_out.active
        return not self.engine.has_unfinished_requests() and not moving

    def kv_paths(self) -> dict[str, str]:
        """Peer id -> how KV goes to it, for this rank's pairs so far: those KV comes in by, and
        those requests move out by (`disagg status`)."""
        paths = self.receiver.transport.paths() if self.receiver is not None else {}
        if self.migrations_out is not None:
            paths.update(self.migrations_out.sender.transport.paths())
        return paths

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self.migrations_out is not None:
            self.migrations_out.sender.close()
