"""The decode (or colocated) instance as a Ray actor, serving DecodeService (disagg.rpc.services).

Tokens leave in batches: after each engine step, the engine thread sends each router one
frame over its request link (disagg.rpc) with the new tokens of all that router's requests.
So the messages per second are one per step per router, never one per token per request, and
nothing queues here: a router that stops reading loses its link (send timeout).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from disagg.worker import sigterm
from disagg.worker.actor_base import WorkerActorBase, engine_load
from disagg.config import Role, WorkerConfig
from disagg.decode_worker.worker import DecodeWorker
from disagg.kv_transfer.layout import KVLayout
from disagg.kv_transfer.factory import make_transport
from disagg.registry import LoadReport
from disagg.request import SamplingParams
from disagg.rpc.server import Link
from disagg.rpc.messages import Reservation, TokenDelta
from disagg.rpc.services import TOKENS_TOPIC, DecodeService

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reserve:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill: KVLayout
    kv_wait_s: float
    priority: int
    stream_to: Link


@dataclass(frozen=True)
class Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    stream_to: Link


@dataclass(frozen=True)
class ReserveMigration:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int
    source: KVLayout
    capacity_tokens: int
    kv_wait_s: float
    priority: int
    stream_to: Link


@dataclass(frozen=True)
class MigrateOut:
    request_id: str
    reservation: Reservation


@dataclass(frozen=True)
class AbortDecode:
    request_id: str


@dataclass(frozen=True)
class DropStreamsOf:
    """A router went away: abort every request whose tokens went to it."""

    link: Link


class DecodeActor(WorkerActorBase, DecodeService):
    service = DecodeService

    def __init__(self, config: WorkerConfig, followers=None):
        """`config.role`: DECODE, or COLOCATED (whole requests here). `followers`: [(RankPlace,
        ShardActor handle)] of the other ranks of a TP x PP instance."""
        if config.role not in (Role.DECODE, Role.COLOCATED):
            raise ValueError(f"role: a decode actor runs the decode or colocated role, not {config.role}")
        super().__init__(config)
        transport = (
            make_transport(config.kv_transport, self.instance_id, config.link_key, self.host, config.engine.device)
            if config.role is Role.DECODE
            else None
        )
        groups, wait_for_ranks = self._start_ranks(followers)
        # One-rank DECODE instances move requests out with their KV over a second transport.
        moves = transport is not None and not followers
        migration_transport = (
            make_transport(
                config.kv_transport, f"{self.instance_id}-move", config.link_key, self.host, config.engine.device
            )
            if moves
            else None
        )
        self.worker = DecodeWorker(
            config.engine,
            transport,
            kv_timeout=config.kv_timeout_s,
            groups=groups,
            followers=self.shards,
            migration_transport=migration_transport,
        )
        if wait_for_ranks is not None:
            wait_for_ranks()
        self._attach_decode_worker()
        self._draining = threading.Event()
        self._catch_sigterm()
        self._start()

    def _attach_decode_worker(self) -> None:
        """The actor's state for `self.worker` (a new one, after a role switch, too)."""
        if self.worker.receiver is not None:
            self.worker.receiver.on_finished = self.loop.wake
        if self.worker.migrations_out is not None:
            self.worker.migrations_out.sender.on_finished = self.loop.wake
        # Engine thread only: where each request's tokens go, and which ones had their first
        # token streamed by the prefill side already.
        self._streams: dict[str, Link] = {}
        self._first_token_pending: set[str] = set()
        self._prefilled_here: set[str] = set()  # submitted whole (colocated, or a local prefill)
        self._transfers: dict[str, tuple[float, int]] = {}  # seconds, bytes

    def load(self) -> LoadReport:
        receiver = self.worker.receiver
        load = engine_load(self.worker.engine, len(self.worker.engine.scheduler.waiting_for_kv) if receiver else 0)
        load.draining = self._draining.is_set()
        return load

    # ---- leaving ----------------------------------------------------------------------------------
    def drain(self, exit_when_done: bool = False) -> None:
        """Leave service: no new requests; routers move the ones here away with their KV (or, where
        they cannot, let them finish here). With `exit_when_done`, the process ends once it holds
        none, or after the config's drain_timeout_s (what is left then migrates by recompute)."""
        if self._draining.is_set():
            return
        self._draining.set()
        logger.info("instance %s draining", self.instance_id)
        if exit_when_done:
            threading.Thread(target=self._exit_when_drained, name="drain", daemon=True).start()

    def resume_service(self) -> None:
        """Back in service after a drain without exit (a role switch that failed, a benchmark)."""
        self._draining.clear()

    def _catch_sigterm(self) -> None:
        """SIGTERM drains, then exits (the default would drop every request here at once)."""
        if not sigterm.install(lambda: self.drain(exit_when_done=True)):
            logger.warning("instance %s: SIGTERM cannot be caught here; it ends the process at once", self.instance_id)

    def _exit_when_drained(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while time.monotonic() < deadline and not self.worker.is_idle():
            time.sleep(0.1)
        time.sleep(0.5)  # the last deltas and acknowledgements leave
        self._deregister()
        os._exit(0)

    async def status(self) -> dict:
        receiver = self.worker.receiver
        return {"load": self.load(), "kv_bytes_received": receiver.num_bytes_total if receiver else 0}

    # ---- DecodeService (on the link's thread) --------------------------------------------------
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill: KVLayout,
        kv_wait_s: float,
        priority: int = 0,
    ) -> Future:
        command = Reserve(request_id, prompt_token_ids, params, prefill, kv_wait_s, priority, self.rpc.caller())
        return self.loop.submit(command)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> Future:
        return self.loop.submit(Submit(request_id, prompt_token_ids, params, priority, self.rpc.caller()))

    def abort(self, request_id: str) -> Future:
        return self.loop.submit(AbortDecode(request_id))

    def migration_layout(self) -> KVLayout | None:
        return self.worker.migration_layout() if self.worker.migrations_out is not None else None

    def reserve_migration(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        num_prompt_tokens: int,
        source: KVLayout,
        capacity_tokens: int,
        kv_wait_s: float,
        priority: int = 0,
    ) -> Future:
        command = ReserveMigration(
            request_id, token_ids, params, num_prompt_tokens, source, capacity_tokens, kv_wait_s, priority,
            self.rpc.caller(),
        )  # fmt: skip
        return self.loop.submit(command)

    def migrate_out(self, request_id: str, reservation: Reservation) -> Future:
        """Answered when the request paused here (the move's `paused`), not when it started."""
        paused: Future = Future()

        def started(future: Future) -> None:
            if future.exception() is not None:
                paused.set_exception(future.exception())
            else:
                future.result().paused.add_done_callback(lambda p: _copy_outcome(p, paused))

        self.loop.submit(MigrateOut(request_id, reservation)).add_done_callback(started)
        return paused

    def _link_closed(self, link: Link) -> None:
        self.loop.submit(DropStreamsOf(link))

    # ---- engine thread -------------------------------------------------------------------------
    def _engine_commands(self) -> dict:
        return {
            Reserve: self._reserve,
            Submit: self._submit,
            AbortDecode: lambda c: self._abort(c.request_id),
            ReserveMigration: self._reserve_migration,
            MigrateOut: self._migrate_out,
            DropStreamsOf: self._drop_streams_of,
        }

    def _reserve(self, command: Reserve) -> Reservation | None:
        reservation = self.worker.reserve(
            command.request_id, command.prompt_token_ids, command.params, command.prefill, command.kv_wait_s,
            command.priority,
        )  # fmt: skip
        if reservation is not None:
            self._first_token_pending.add(command.request_id)
            self._streams[command.request_id] = command.stream_to
        return reservation

    def _reserve_migration(self, command: ReserveMigration) -> Reservation | None:
        reservation = self.worker.reserve_migration(
            command.request_id, command.token_ids, command.params, command.num_prompt_tokens, command.source,
            command.capacity_tokens, command.kv_wait_s, command.priority,
        )  # fmt: skip
        if reservation is not None:
            self._first_token_pending.add(command.request_id)  # its first output: the source's last token
            self._streams[command.request_id] = command.stream_to
        return reservation

    def _migrate_out(self, command: MigrateOut):
        move = self.worker.migrate_out(command.request_id, command.reservation)
        # Once it runs there, nothing more of it leaves here (a failed move streams on from here).
        move.done.add_done_callback(lambda done: done.result() and self._streams.pop(command.request_id, None))
        return move

    def _submit(self, command: Submit) -> None:
        self.worker.add_request(command.request_id, command.prompt_token_ids, command.params, command.priority)
        self._streams[command.request_id] = command.stream_to
        self._prefilled_here.add(command.request_id)

    def _abort(self, request_id: str) -> bool:
        self._transfers.pop(request_id, None)
        self._streams.pop(request_id, None)
        self._first_token_pending.discard(request_id)
        self._prefilled_here.discard(request_id)
        return self.worker.abort(request_id)

    def _drop_streams_of(self, command: DropStreamsOf) -> None:
        for request_id in [r for r, to in self._streams.items() if to is command.link]:
            self._abort(request_id)

    def _kv_endpoint(self):
        return self.worker.receiver

    def _handle_outputs(self, outputs) -> None:
        self._transfers.update((r.request_id, (r.seconds, r.num_bytes)) for r in self.worker.transfer_results if r.ok)
        deltas = [self._delta(out) for out in outputs]
        deltas += [TokenDelta.failed(f.request_id, f.error) for f in self.worker.failed]
        self._first_token_pending.difference_update(f.request_id for f in self.worker.failed)
        self._publish(deltas)

    def _delta(self, out) -> TokenDelta:
        if out.error is not None:
            self._first_token_pending.discard(out.request_id)
            return TokenDelta.failed(out.request_id, f"decode step failed on this request: {out.error}", True)
        completion = out.outputs[0]
        token_ids, text = list(out.new_token_ids), out.new_text
        if out.request_id in self._first_token_pending:  # DECODE: token 1 was streamed by the prefill worker
            self._first_token_pending.discard(out.request_id)
            token_ids, text = token_ids[1:], ""
        logprobs = []
        if completion.logprobs:
            logprobs = (
                [lp.get(t, float("nan")) for lp, t in zip(completion.logprobs[-len(token_ids) :], token_ids)]
                if token_ids
                else []
            )
        m, now = out.metrics, time.perf_counter()
        whole = out.request_id in self._prefilled_here  # its queue and prefill times are this instance's
        if out.finished:
            self._prefilled_here.discard(out.request_id)
        transfer_s, transfer_bytes = (self._transfers.pop if out.finished else self._transfers.get)(
            out.request_id, (0.0, 0)
        )
        return TokenDelta(
            request_id=out.request_id,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            finished=out.finished,
            finish_reason=completion.finish_reason,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_cached_tokens=out.num_cached_tokens,
            num_output_tokens=len(completion.token_ids),
            queue_s=m.queue_seconds() if whole else 0.0,
            prefill_s=m.prefill_seconds(now) if whole else 0.0,
            transfer_s=transfer_s,
            transfer_bytes=transfer_bytes,
            decode_s=m.decode_seconds(now) if out.finished else 0.0,
        )

    def _publish(self, deltas: list[TokenDelta]) -> None:
        """One frame per router with this step's deltas of its requests."""
        by_link: dict[Link, list[TokenDelta]] = {}
        for delta in deltas:
            link = self._streams.pop(delta.request_id, None) if delta.finished else self._streams.get(delta.request_id)
            if link is not None:
                by_link.setdefault(link, []).append(delta)
        for link, batch in by_link.items():
            link.send_event(TOKENS_TOPIC, batch)  # a broken link aborts its requests (_link_closed)

    def _fail_all(self, exc: Exception) -> None:
        engine = self.worker.engine
        ids = list(engine.scheduler.requests)
        for request_id in ids:
            self.worker.abort(request_id)
        self._publish([TokenDelta.failed(r, f"decode step failed: {exc}") for r in ids])


def _copy_outcome(source: Future, target: Future) -> None:
    if source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())
