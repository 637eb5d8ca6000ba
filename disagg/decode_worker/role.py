"""The decode role: an engine in the DECODE role that takes KV from prefill instances and streams
tokens; or, without a transport, the COLOCATED role, which runs whole requests itself with
chunked prefill (the baseline that disaggregation is measured against).

The worker (disagg.worker.actor) holds it and runs its methods on the engine thread; it keeps
one record per request (`DecodeRequest`). `reserve` is the handshake: blocks for the prompt are
allocated now and their ids returned, and every rank's receiver starts listening to the prefill
ranks that hold its slice. When the KV and the first token are in, the request joins the decode
batch.

Tokens leave in batches: after each engine step, each router gets one frame over its request
link (disagg.rpc) with the new tokens of all that router's requests. So the messages per second
are one per step per router, never one per token per request, and nothing queues here: a router
that stops reading loses its link (send timeout).

With a second transport (`migration_transport`) a decoding request can move to another decode
instance with its KV, and requests can arrive from others that way (disagg.decode_worker.migration).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from disagg.config import EngineConfig, Role
from disagg.decode_worker.migration import Incoming, MigrationSource, Outgoing, finish_arrival, reserve_arrival
from disagg.engine.distributed import InstanceGroups
from disagg.engine.engine import LLMEngine
from disagg.engine.outputs import RequestOutput
from disagg.kv_transfer.connector import assemble, instance_kv_layout
from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVLayout, sources_for, targets_for
from disagg.kv_transfer.other_ranks import OtherRanks
from disagg.kv_transfer.peer_blocks import PeerBlocks
from disagg.kv_transfer.sender import KVSender
from disagg.kv_transfer.tally import RankTally
from disagg.kv_transfer.transport import Transport
from disagg.request import SamplingParams
from disagg.rpc.messages import Reservation, TokenDelta
from disagg.rpc.server import Link
from disagg.rpc.services import TOKENS_TOPIC


@dataclass
class DecodeRequest:
    """One request here, from its reservation (or submission) to its last delta (engine thread)."""

    link: Link | None = None  # where its tokens stream (None: nobody's)
    # Its first output's token went out already (the prefill's first token, or a moved request's
    # last one at its source): that output streams from the token after it.
    first_token_sent: bool = False
    prefilled_here: bool = False  # submitted whole: its queue and prefill times are this instance's
    tally: RankTally | None = None  # its KV on its way in: the ranks that have not reported
    transfer_s: float = 0.0  # how long its KV took to come, and its bytes
    transfer_bytes: int = 0
    arriving: Incoming | None = None  # moving here from another instance
    moving: Outgoing | None = None  # moving out of here


@dataclass(frozen=True)
class FailedRequest:
    request_id: str
    error: str


class DecodeRole:
    def __init__(
        self,
        config: EngineConfig,
        transport: Transport | None,
        *,
        kv_timeout: float,
        wake: Callable[[], None] | None = None,
        groups: InstanceGroups | None = None,
        followers: OtherRanks | None = None,
        migration_transport: Transport | None = None,
        engine: LLMEngine | None = None,
        export_transport: Transport | None = None,
    ):
        """Without a transport: the COLOCATED role. `wake`: the engine loop's (a transfer
        finished: a step is due). `groups`, `followers`: rank 0 of a TP x PP instance (its process
        groups, the other ranks). `migration_transport`: what moving requests out goes over
        (None: they cannot move out; one rank only). `engine`: an idle engine to take over,
        switched to this role (a role switch). `export_transport`: what its cached blocks are lent
        to prefill instances over (disagg.kv_transfer.peer_blocks; None: not)."""
        self.kind = Role.DECODE if transport is not None else Role.COLOCATED  # what its worker serves as
        built = assemble(
            config,
            self.kind,
            kv_timeout=kv_timeout,
            transport=transport,
            groups=groups,
            followers=followers,
            engine=engine,
            wake=wake,
        )
        self.engine, self.receiver = built.engine, built.endpoint
        self.migrations_out: MigrationSource | None = None
        if migration_transport is not None:
            if followers is not None:
                raise ValueError("migration: an instance of several ranks cannot move requests yet")
            sender = KVSender(migration_transport, timeout=kv_timeout, wake=wake)
            sender.register_kv_cache(self.engine.kv_cache)
            self.migrations_out = MigrationSource(self.engine, sender)
        self.followers = followers
        self.requests: dict[str, DecodeRequest] = {}
        self.failed: list[FailedRequest] = []  # the latest step's transfer failures
        self.transfer_results: list[TransferResult] = []
        self._layout: KVLayout | None = None
        self.peers = PeerBlocks.build(self.engine, export_transport, kv_timeout=kv_timeout, wake=wake)

    def address(self) -> str:
        return self.receiver.address() if self.receiver is not None else ""

    def kv_layout(self) -> KVLayout | None:
        """Every rank's KV endpoint (None: colocated); fixed once the other ranks joined."""
        if self._layout is None:
            self._layout = instance_kv_layout(
                self.engine.config, self.receiver, self.followers.kv_ranks if self.followers is not None else []
            )
        return self._layout

    def status(self) -> dict:
        return {"kv_bytes_received": self.receiver.num_bytes_total if self.receiver is not None else 0}

    # ---- DecodeService (engine thread, except migration_layout) ----------------------------------
    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill: KVLayout,
        kv_wait_s: float | None = None,
        priority: int = 0,
        link: Link | None = None,
    ) -> Reservation | None:
        """The handshake with the prefill instance whose ranks are `prefill` (any parallel plan):
        pre-allocate the prompt's blocks and have every rank of this instance listen to the
        prefill ranks that hold its slice of the KV; None when there is no room now. The first
        KV must arrive within `kv_wait_s` (None: the kv timeout), and each later arrival within
        the kv timeout of the one before, else the request fails. Its tokens stream to `link`."""
        block_ids = self.engine.reserve_for_remote_prefill(request_id, prompt_token_ids, params, priority=priority)
        if block_ids is None:
            return None
        cfg, layout = self.engine.model_config, self.kv_layout()
        sources = [
            sources_for(rank.place, prefill, layout.plan, cfg.num_hidden_layers, cfg.num_key_value_heads)
            for rank in layout.ranks
        ]
        transfer_ids = [self.receiver.expect(request_id, block_ids, sources[0], kv_wait_s)]
        if self.followers is not None:
            transfer_ids += self.followers.expect(request_id, block_ids, sources[1:], kv_wait_s)
        by_peer = {rank.peer_id: transfer_id for rank, transfer_id in zip(layout.ranks, transfer_ids)}
        self.requests[request_id] = DecodeRequest(link, first_token_sent=True, tally=RankTally(len(layout.ranks)))
        return Reservation(transfer_ids[0], block_ids, by_peer, layout)

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        link: Link | None = None,
    ) -> None:
        """Run the whole request here: the COLOCATED role, or a short prompt the router chose to
        prefill on this DECODE instance (conditional disaggregation) as a chunk of its steps."""
        self.engine.add_request(
            request_id, prompt_token_ids=prompt_token_ids, sampling_params=params, priority=priority
        )
        self.requests[request_id] = DecodeRequest(link, prefilled_here=True)

    def abort(self, request_id: str) -> bool:
        """Drop the request (no more of its tokens go out) and free its blocks; False if the
        engine did not have it."""
        self.peers.abort(request_id)  # (a block export, by its id)
        return self._drop(request_id, self.requests.pop(request_id, None))

    # ---- lending cached blocks to prefill instances (engine thread, except peer_export_layout) ----
    def peer_export_layout(self) -> KVLayout | None:
        """Where this instance lends cached blocks from (None: it lends none). Fixed."""
        return self.peers.export_layout()

    def export_prefix(self, export_id: str, token_ids: list[int], num_blocks: int, slot: Reservation) -> Future:
        """Lend the first `num_blocks` full blocks of `token_ids` into a peer's `slot`; the Future:
        True once it has them, False when this pool does not hold them (or the transfer failed)."""
        return self.peers.export(export_id, token_ids, num_blocks, slot.layout, slot.transfer_id, slot.block_ids)

    def drop_link(self, link: Link) -> None:
        """A router went away: abort every request whose tokens went to it."""
        for request_id in [r for r, request in self.requests.items() if request.link is link]:
            self.abort(request_id)

    # ---- live migration (engine thread) ----------------------------------------------------------
    def migration_layout(self) -> KVLayout | None:
        """Where requests moving out of here send their KV from (a target's `reserve_migration`);
        None: they cannot move out. Fixed: answered from any thread."""
        if self.migrations_out is None:
            return None
        sender = self.migrations_out.sender
        return KVLayout.single(sender.worker_id, sender.address())

    def reserve_migration(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        num_prompt_tokens: int,
        source: KVLayout,
        capacity_tokens: int,
        kv_wait_s: float | None = None,
        priority: int = 0,
        link: Link | None = None,
    ) -> Reservation | None:
        """Room for a request moving here from the instance whose migration senders are `source`:
        its attempt (`params`, a prompt of `num_prompt_tokens`, `priority`) has `token_ids` with
        KV now; up to `capacity_tokens` positions. None when there is no room. Once it decodes
        here its tokens stream to `link`, from the one after its source's last."""
        if self.receiver is None or self.followers is not None:
            raise ValueError("migration: only a one-rank DECODE instance takes moving requests")
        arrival = reserve_arrival(
            self.engine, request_id, token_ids, params, num_prompt_tokens, capacity_tokens, priority
        )
        if arrival is None:
            return None
        block_ids, incoming = arrival
        rank = self.kv_layout().ranks[0]
        sources = {p.peer_id: p.address for p in source.ranks}
        transfer_id = self.receiver.expect(request_id, block_ids, sources, kv_wait_s)
        self.requests[request_id] = DecodeRequest(link, first_token_sent=True, tally=RankTally(1), arriving=incoming)
        return Reservation(transfer_id, block_ids, {rank.peer_id: transfer_id}, self.kv_layout())

    def migrate_out(self, request_id: str, reservation: Reservation) -> Future:
        """Start moving a decoding request into another instance's reservation. The Future
        answers once it paused here: its tokens then (the target gets them with the KV); its
        record's move (`requests[request_id].moving`) says, when done, whether it runs there now
        (its record leaves) or went on here."""
        if self.migrations_out is None:
            raise ValueError("migration: this worker has no migration transport")
        request = self.requests.get(request_id)
        if request is None or request.moving is not None:
            raise ValueError(f"migrate: {request_id!r} is not decoding here, or is moving already")
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
        request.moving = self.migrations_out.start(request_id, targets)
        return request.moving.paused

    # ---- the loop ----------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """A step is due: something decodes, or a transfer or a move has news. (Requests waiting
        only for KV need none: the receiver's wake brings the loop back.)"""
        scheduler = self.engine.scheduler
        busy = bool(scheduler.running or scheduler.waiting) or self.needs_sync() or self.peers.has_news()
        return busy or (self.receiver is not None and self.receiver.has_finished())

    def needs_sync(self) -> bool:
        """The other ranks hold transfers still under way, or a move out ended: a step is due."""
        moved_out = self.migrations_out is not None and self.migrations_out.sender.has_finished()
        return moved_out or (self.followers is not None and self._tallying())

    def step(self) -> list[RequestOutput]:
        """Admit requests whose KV arrived (their first-token output comes first), decode, and
        send each router this step's deltas of its requests."""
        outputs, arrivals = [], []
        self.failed = []
        self.peers.settle()
        if self.migrations_out is not None and self.migrations_out.active:
            self.migrations_out.before_step(self._moves())  # pre-copies that are over pause here
        self.transfer_results = self._finished_transfers()
        for result in self.transfer_results:
            request = self.requests[result.request_id]  # (a tallied transfer's request has its record)
            if result.ok:
                request.transfer_s, request.transfer_bytes = result.seconds, result.num_bytes
            if result.ok and request.arriving is not None:
                request.arriving.kv = result
                arrivals.append(result.request_id)
            elif result.ok:
                outputs.append(self.engine.finish_kv_import(result.request_id, result.first_token))
            else:
                self._fail(result.request_id, result.error or "KV transfer failed")
        outputs.extend(self._arrived(arrivals))
        outputs.extend(self.engine.step())
        if self.migrations_out is not None and self.migrations_out.active:
            self.migrations_out.after_step(self._move_of)  # moves that ended: freed here, or resumed
            self._forget_moves()
        deltas = [self._delta(out) for out in outputs]
        self._publish(deltas + [TokenDelta.failed(f.request_id, f.error) for f in self.failed])
        return outputs

    def fail_all(self, exc: Exception) -> None:
        """A step raised: end every request here with an error."""
        ids = list(self.engine.scheduler.requests)
        for request_id in ids:
            self._drop(request_id, self.requests.get(request_id))
        self._publish([TokenDelta.failed(r, f"decode step failed: {exc}") for r in ids])

    def is_idle(self) -> bool:
        moving = self.migrations_out is not None and self.migrations_out.active
        return not self.engine.has_unfinished_requests() and not moving and not self.peers.active

    def kv_paths(self) -> dict[str, str]:
        """Peer id -> how KV goes to it, for this rank's pairs so far: those KV comes in by, and
        those requests move out by (`disagg status`)."""
        paths = self.receiver.transport.paths() if self.receiver is not None else {}
        if self.migrations_out is not None:
            paths.update(self.migrations_out.sender.transport.paths())
        return paths  # (not the peer fetch's pairs: their ids name no instance)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        if self.migrations_out is not None:
            self.migrations_out.sender.close()
        self.peers.close()

    # ---- inside a step -----------------------------------------------------------------------------
    def _finished_transfers(self) -> list[TransferResult]:
        """Whole requests' transfers that ended (every rank's slice, or the first that failed)."""
        if self.receiver is None:
            return []
        results = self.receiver.poll()
        if self.followers is not None:
            if self._tallying() and not self.engine.scheduler.running:
                self.followers.sync()  # no step will bring their news: ask
            results += self.followers.take_results()
        return [done for done in map(self._tallied, results) if done is not None]

    def _tallied(self, result: TransferResult) -> TransferResult | None:
        request = self.requests.get(result.request_id)
        if request is None or request.tally is None:
            return None  # already reported (failed), or aborted
        done = request.tally.add(result)
        if done is not None:
            request.tally = None
        return done

    def _tallying(self) -> bool:
        return any(r.tally is not None for r in self.requests.values())

    def _arrived(self, request_ids: list[str]) -> list[RequestOutput]:
        """Moved requests whose KV and tokens are in, now decoding here."""
        outputs = []
        for request_id in request_ids:
            request = self.requests[request_id]
            incoming, request.arriving = request.arriving, None
            try:
                outputs.append(finish_arrival(self.engine, request_id, incoming))
            except ValueError as exc:
                self._fail(request_id, str(exc))
        return outputs

    def _fail(self, request_id: str, error: str) -> None:
        """Its KV never came whole: it ends here with `error` (the router may move it on)."""
        self.engine.abort_request(request_id)
        self.failed.append(FailedRequest(request_id, error))

    def _moves(self) -> list[Outgoing]:
        return [r.moving for r in self.requests.values() if r.moving is not None]

    def _move_of(self, request_id: str) -> Outgoing | None:
        request = self.requests.get(request_id)
        return request.moving if request is not None else None

    def _forget_moves(self) -> None:
        """Moves that ended: a request that runs elsewhere now leaves; one that could not move
        goes on here."""
        for request_id, request in list(self.requests.items()):
            move = request.moving
            if move is not None and move.done.done():
                request.moving = None
                if move.done.result():
                    del self.requests[request_id]

    def _drop(self, request_id: str, request: DecodeRequest | None) -> bool:
        if request is not None and request.moving is not None:
            self.migrations_out.abort(request.moving)
        if self.receiver is not None:  # before the blocks are freed: no late write lands in them
            self.receiver.abort(request_id)
            if self.followers is not None:
                self.followers.abort_transfers(request_id)
        return self.engine.abort_request(request_id)

    # ---- token deltas ------------------------------------------------------------------------------
    def _delta(self, out: RequestOutput) -> TokenDelta:
        request = self.requests.get(out.request_id) or DecodeRequest()
        if out.error is not None:
            return TokenDelta.failed(out.request_id, f"decode step failed on this request: {out.error}", True)
        completion = out.outputs[0]
        token_ids, text = list(out.new_token_ids), out.new_text
        if request.first_token_sent:  # DECODE: token 1 was streamed by the prefill worker (or the source)
            request.first_token_sent = False
            token_ids, text = token_ids[1:], ""
        logprobs = []
        if completion.logprobs and token_ids:
            logprobs = [lp.get(t, float("nan")) for lp, t in zip(completion.logprobs[-len(token_ids) :], token_ids)]
        m, now = out.metrics, time.perf_counter()
        whole = request.prefilled_here  # its queue and prefill times are this instance's
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
            transfer_s=request.transfer_s,
            transfer_bytes=request.transfer_bytes,
            decode_s=m.decode_seconds(now) if out.finished else 0.0,
        )

    def _publish(self, deltas: list[TokenDelta]) -> None:
        """One frame per router with this step's deltas of its requests; a finished request's
        record leaves."""
        by_link: dict[Link, list[TokenDelta]] = {}
        for delta in deltas:
            request = (
                self.requests.pop(delta.request_id, None) if delta.finished else self.requests.get(delta.request_id)
            )
            if request is not None and request.link is not None:
                by_link.setdefault(request.link, []).append(delta)
        for link, batch in by_link.items():
            link.send_event(TOKENS_TOPIC, batch)  # a broken link aborts its requests (drop_link)
