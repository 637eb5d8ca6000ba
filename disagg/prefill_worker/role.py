"""The prefill role: an engine in the PREFILL role whose KV streams to decode instances.

The worker (disagg.worker.actor) holds it and runs its methods on the engine thread; it keeps
one record per request (`PrefillRequest`). `prefill`'s answer is the first token (that is the
request's TTFT), set on the engine thread as soon as the token exists, so its reply leaves from
there; the KV keeps streaming in the background and the blocks are freed on its ack.

A request starts before the decode side has answered the handshake, so each request is a polled
state machine:

    AWAITING_TARGETS -> STREAMING -> AWAITING_ACK -> DONE | FAILED

AWAITING_TARGETS: the prefill computes and its KV stays in this instance's blocks. When the
targets come (`set_kv_targets`, from any thread) this rank's sender learns its own before the
next layer's KV goes out (the layers computed before go first); the other ranks get theirs with
the next step. If the prompt finished meanwhile, what was computed goes out at once and the DONE
follows. Without targets within the kv timeout the request is dropped and its blocks freed.
STREAMING: layers go out as computed. AWAITING_ACK: the first token went out with the DONE; the
blocks are freed on every rank's acknowledgement (DONE), or when a transfer fails (FAILED).
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from disagg.config import EngineConfig, Role
from disagg.engine.distributed import InstanceGroups
from disagg.engine.engine import LLMEngine
from disagg.engine.outputs import RequestOutput
from disagg.errors import KVTransferError, RequestFailedError
from disagg.kv_transfer.connector import assemble, instance_kv_layout
from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVLayout, KVTarget, targets_for
from disagg.kv_transfer.other_ranks import OtherRanks
from disagg.kv_transfer.peer_blocks import PeerBlocks
from disagg.kv_transfer.tally import RankTally
from disagg.kv_transfer.transport import Transport
from disagg.request import SamplingParams
from disagg.rpc.messages import PrefillResult, Reservation
from disagg.rpc.server import Link

logger = logging.getLogger(__name__)


class PrefillState(enum.Enum):
    AWAITING_TARGETS = "awaiting_targets"  # computing (or done), the handshake's answer pending
    STREAMING = "streaming"  # targets in force: layers go out as computed
    AWAITING_ACK = "awaiting_ack"  # first token sent with the DONE; waiting for every rank's ACK
    DONE = "done"
    FAILED = "failed"


@dataclass
class PrefillRequest:
    """One request here, from its `prefill` call to its KV's acknowledgement (engine thread)."""

    deadline: float  # for its targets to come
    link: Link | None = None  # the router that asked: its link closing before the first token aborts it
    first_token: Future = field(default_factory=Future)  # the answer to `prefill`: a PrefillResult
    state: PrefillState = PrefillState.AWAITING_TARGETS
    token_id: int | None = None  # the first token, once the prompt is done (maybe before its targets)
    tally: RankTally | None = None  # its KV on its way: the ranks that have not reported


@dataclass
class _TargetsArrival:
    request_id: str
    reservation: Reservation
    deadline: float  # for its request to be there (the targets may overtake its `prefill`)
    done: Future = field(default_factory=Future)


class PrefillRole:
    kind = Role.PREFILL  # what the worker holding it serves as

    def __init__(
        self,
        config: EngineConfig,
        transport: Transport,
        *,
        kv_timeout: float,
        wake: Callable[[], None] | None = None,
        groups: InstanceGroups | None = None,
        followers: OtherRanks | None = None,
        engine: LLMEngine | None = None,
        export_transport: Transport | None = None,
        import_transport: Transport | None = None,
    ):
        """`wake`: the engine loop's (a transfer finished, targets came: a step is due).
        `groups`, `followers`: rank 0 of a TP x PP instance (its process groups, the other ranks).
        `engine`: an idle engine to take over, switched to PREFILL (a role switch).
        `export_transport`, `import_transport`: what cached blocks are lent to peers and fetched
        from them over (disagg.kv_transfer.peer_blocks; None: not)."""
        built = assemble(
            config,
            Role.PREFILL,
            kv_timeout=kv_timeout,
            transport=transport,
            groups=groups,
            followers=followers,
            engine=engine,
            wake=wake,
        )
        self.engine, self.sender = built.engine, built.endpoint
        self.followers = followers
        self.kv_timeout = kv_timeout
        self._wake = wake
        self.requests: dict[str, PrefillRequest] = {}
        self._arrivals: deque[_TargetsArrival] = deque()  # from link threads, taken on the engine thread
        self._early: list[_TargetsArrival] = []  # came before their request: applied when it is here
        self.transfer_results: list[TransferResult] = []  # the latest step's, for metrics
        self._layout: KVLayout | None = None
        self.peers = PeerBlocks.build(self.engine, export_transport, import_transport, kv_timeout=kv_timeout, wake=wake)

    def address(self) -> str:
        return self.sender.address()

    def kv_layout(self) -> KVLayout:
        """Every rank's KV endpoint; fixed once the other ranks joined (before serving)."""
        if self._layout is None:
            self._layout = instance_kv_layout(
                self.engine.config, self.sender, self.followers.kv_ranks if self.followers is not None else []
            )
        return self._layout

    def status(self) -> dict:
        return {"kv_bytes_sent": self.sender.num_bytes_total, "peer_fetch": self.peers.report()}

    # ---- PrefillService (engine thread, except set_kv_targets) ---------------------------------------
    def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        link: Link | None = None,
    ) -> Future:
        """Queue the prefill (by `priority`); its KV waits here for `set_kv_targets` (at most the
        kv timeout). The Future answers its first token (a PrefillResult). Prefix blocks fetched
        from a peer for it are in the prefix cache first, if they came."""
        self.peers.settle()
        self.engine.add_request(
            request_id, prompt_token_ids=prompt_token_ids, sampling_params=params, priority=priority
        )
        request = self.requests[request_id] = PrefillRequest(time.monotonic() + self.kv_timeout, link)
        return request.first_token

    def set_kv_targets(self, request_id: str, reservation: Reservation) -> Future:
        """Where the request's KV goes (the decode instance's reservation). Callable from any
        thread, also while the request's step runs; the Future resolves on the engine thread:
        True once the targets are in force, False if the request is gone."""
        arrival = _TargetsArrival(request_id, reservation, time.monotonic() + self.kv_timeout)
        self.sender.add_later(request_id, lambda: self._own_targets(request_id, reservation))
        self._arrivals.append(arrival)
        if self._wake is not None:
            self._wake()
        return arrival.done

    def abort(self, request_id: str) -> bool:
        """Drop the request and free its blocks; its `prefill` call, if unanswered, ends CANCELLED."""
        request = self.requests.get(request_id)
        if request is not None:
            request.first_token.cancel()
        self.peers.abort(request_id)  # (a fetch for it, by its id)
        return self._drop(request_id)

    # ---- PeerBlockService (engine thread, except peer_export_layout) ---------------------------------
    def peer_export_layout(self) -> KVLayout | None:
        """Where this instance lends cached blocks from (None: it lends none). Fixed."""
        return self.peers.export_layout()

    def reserve_peer_import(
        self, import_id: str, token_ids: list[int], num_blocks: int, source: KVLayout
    ) -> Reservation | None:
        """Blocks for the first `num_blocks` full blocks of `token_ids`, those it lacks to come
        from `source` (a holder's export layout); None when it lacks none, has no room, or fetches
        none (disagg.kv_transfer.peer_blocks)."""
        imports = self.peers.imports
        slot = imports.reserve(import_id, token_ids, num_blocks, source) if imports is not None else None
        if slot is None:
            return None
        layout = imports.layout()
        return Reservation(slot.transfer_id, slot.block_ids, {layout.ranks[0].peer_id: slot.transfer_id}, layout)

    def export_prefix(self, export_id: str, token_ids: list[int], num_blocks: int, slot: Reservation) -> Future:
        """Lend the first `num_blocks` full blocks of `token_ids` into a peer's `slot`; the Future:
        True once it has them, False when this pool does not hold them (or the transfer failed)."""
        return self.peers.export(export_id, token_ids, num_blocks, slot.layout, slot.transfer_id, slot.block_ids)

    def drop_link(self, link: Link) -> None:
        """A router went away: drop the requests whose first token it was waiting for."""
        for request_id, request in list(self.requests.items()):
            if request.link is link and not request.first_token.done():
                self.abort(request_id)

    # ---- the loop ------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """A step is due: something computes, targets to apply, a deadline passed, or the sender
        or the other ranks have news. (Requests waiting only for an ACK need none: the sender's
        wake brings the loop back.)"""
        scheduler = self.engine.scheduler
        busy = bool(scheduler.running or scheduler.waiting) or self.needs_sync() or self.sender.has_finished()
        return busy or self.peers.has_news()

    def needs_sync(self) -> bool:
        """A step is due although nothing computes: targets to apply, the other ranks have commands
        to receive or transfers under way, or a request waited too long for its targets."""
        now = time.monotonic()
        if self._arrivals or any(now > a.deadline for a in self._early) or self._targets_overdue(now):
            return True
        if self.followers is None:
            return False
        return self.followers.has_commands() or self._tallying()

    def step(self) -> list[RequestOutput]:
        """One engine step; first tokens are answered and go out with DONE; acknowledged blocks
        are freed."""
        self._apply_arrivals()  # before the step: the other ranks get their targets with it
        self.peers.settle()
        scheduler = self.engine.scheduler
        computes = bool(scheduler.running or scheduler.waiting)
        outputs = self.engine.step()
        for out in outputs:
            if out.error is not None:  # the engine ended it: drop its transfer state too
                self._end(out.request_id, RequestFailedError(f"prefill step failed on this request: {out.error}"))
            elif out.finished:
                self._prompt_done(out)
        self._apply_arrivals()
        self._expire_awaiting_targets()
        self.transfer_results = self._finished_transfers(computes)
        for result in self.transfer_results:
            self._transfer_finished(result)
        return outputs

    def fail_all(self, exc: Exception) -> None:
        """A step raised: end every request here with an error."""
        for request_id in list(self.engine.scheduler.requests):
            self._end(request_id, RuntimeError(f"prefill step failed: {exc}"))

    def is_idle(self) -> bool:
        """No request left to compute and no blocks held for a transfer."""
        held = self.engine.has_unfinished_requests() or self.engine.scheduler.held_for_export
        return not held and not self.peers.active

    def kv_paths(self) -> dict[str, str]:
        """Peer id -> how KV goes to it, for this rank's pairs so far (`disagg status`)."""
        return self.sender.transport.paths()  # (not the peer fetch's pairs: their ids name no instance)

    def close(self) -> None:
        self.sender.close()
        self.peers.close()

    # ---- state transitions ---------------------------------------------------------------------------
    def _prompt_done(self, out: RequestOutput) -> None:
        request = self.requests.get(out.request_id)
        if request is None:  # nobody to send the KV to: nothing to hold it for
            self.engine.release_kv(out.request_id)
            return
        request.token_id = out.outputs[0].token_ids[0]
        _settle(request.first_token, _first_token_result(out))  # its link replies from this thread, now
        if request.state is PrefillState.STREAMING:  # else the KV waits here for its targets
            self._finish_transfer(out.request_id, request)

    def _end(self, request_id: str, exc: BaseException) -> None:
        """The request failed here: its `prefill` call, if unanswered, gets `exc`."""
        request = self.requests.get(request_id)
        if request is not None:
            _settle(request.first_token, exc=exc)
        self._drop(request_id)

    def _drop(self, request_id: str) -> bool:
        """Forget the request, stop its transfers and free its blocks; whether the engine had it."""
        self.requests.pop(request_id, None)
        for arrival in [a for a in self._early if a.request_id == request_id]:
            self._early.remove(arrival)
            arrival.done.set_result(False)
        self._abort_transfers(request_id)
        found = self.engine.abort_request(request_id)
        self.engine.release_kv(request_id)
        return found

    def _apply_arrivals(self) -> None:
        """Targets in force for the requests they came for; those that came before their request
        wait for it (a link may hand them over before the engine thread ran its `prefill`)."""
        if not (self._arrivals or self._early):
            return
        self.sender.add_deferred()
        while self._arrivals:
            self._early.append(self._arrivals.popleft())
        now, waiting = time.monotonic(), []
        for arrival in self._early:
            if arrival.request_id in self.requests:
                arrival.done.set_result(self._start_streaming(arrival.request_id, arrival.reservation))
            elif now > arrival.deadline:  # its request is gone (or never came)
                arrival.done.set_result(False)
            else:
                waiting.append(arrival)
        self._early = waiting

    def _start_streaming(self, request_id: str, reservation: Reservation) -> bool:
        request = self.requests[request_id]
        scheduled = self.engine.scheduler.requests.get(request_id)
        if scheduled is None or request.state is not PrefillState.AWAITING_TARGETS:
            return False
        self.sender.add(request_id, self._targets(self.kv_layout().ranks[0], reservation))  # (a no-op if added)
        self._register_follower_targets(request_id, request, reservation)
        request.state = PrefillState.STREAMING
        if request.token_id is not None:  # the prompt is done: send what has not gone out, then DONE
            self.sender.catch_up(request_id, scheduled.block_ids, scheduled.num_computed_tokens)
            if self.followers is not None:
                self.followers.catch_up(request_id, scheduled.block_ids, scheduled.num_computed_tokens)
            self._finish_transfer(request_id, request)
        return True  # otherwise the next steps stream it, every rank the layers it computed before first

    def _finish_transfer(self, request_id: str, request: PrefillRequest) -> None:
        request.state = PrefillState.AWAITING_ACK
        self.sender.finish(request_id, request.token_id)
        if self.followers is not None:
            self.followers.finish_transfer(request_id)

    def _transfer_finished(self, result: TransferResult) -> None:
        request = self.requests.pop(result.request_id, None)
        if request is not None:
            request.state = PrefillState.DONE if result.ok else PrefillState.FAILED
        if result.ok:
            self.engine.release_kv(result.request_id)
            return
        if request is not None:  # failed before the first token went out: the caller must know
            _settle(request.first_token, exc=KVTransferError(result.error or "KV transfer failed"))
        if self.followers is not None:  # the prompt may still be computing: stop it too, wherever it is
            self.followers.abort_transfers(result.request_id)
        self.engine.abort_request(result.request_id)

    def _expire_awaiting_targets(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, p in self.requests.items() if _awaits_targets(p) and now > p.deadline]:
            logger.warning("request %s: no KV targets arrived in time; dropping it", request_id)
            self._end(request_id, KVTransferError("no KV targets arrived within the kv timeout"))

    def _targets_overdue(self, now: float) -> bool:
        return any(_awaits_targets(p) and now > p.deadline for p in self.requests.values())

    # ---- targets -------------------------------------------------------------------------------------
    def _own_targets(self, request_id: str, reservation: Reservation) -> list[KVTarget] | None:
        """This rank's targets, if the request still awaits them (engine thread, mid-step too)."""
        request = self.requests.get(request_id)
        if request is None or not _awaits_targets(request):
            return None
        return self._targets(self.kv_layout().ranks[0], reservation)

    def _register_follower_targets(self, request_id: str, request: PrefillRequest, reservation: Reservation) -> None:
        layout = self.kv_layout()
        for index, rank in enumerate(layout.ranks[1:]):  # delivered with the next step, before it computes
            self.followers.add_targets(index, request_id, self._targets(rank, reservation))
        request.tally = RankTally(len(layout.ranks))

    def _targets(self, rank, reservation: Reservation) -> list[KVTarget]:
        cfg = self.engine.model_config
        return targets_for(
            rank.place,
            self.kv_layout().plan,
            reservation.layout,
            reservation.transfer_ids,
            reservation.block_ids,
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
        )

    def _abort_transfers(self, request_id: str) -> None:
        self.sender.abort(request_id)
        if self.followers is not None:
            self.followers.abort_transfers(request_id)

    def _finished_transfers(self, computed: bool) -> list[TransferResult]:
        """Whole requests' transfers that ended (every rank's slice, or the first that failed)."""
        results = self.sender.poll()
        if self.followers is not None:
            if self.followers.has_commands() or (self._tallying() and not computed):
                self.followers.sync()
            results += self.followers.take_results()
        return [done for done in map(self._tallied, results) if done is not None]

    def _tallying(self) -> bool:
        """Some request's ranks have not all reported (their news comes with a step or a sync)."""
        return any(r.tally is not None for r in self.requests.values())

    def _tallied(self, result: TransferResult) -> TransferResult | None:
        request = self.requests.get(result.request_id)
        if request is None or request.tally is None:
            return None  # already reported (failed), or not streaming
        done = request.tally.add(result)
        if done is not None:
            request.tally = None
        return done


def _awaits_targets(request: PrefillRequest) -> bool:
    return request.state is PrefillState.AWAITING_TARGETS


def _settle(future: Future, result=None, exc: BaseException | None = None) -> None:
    """Answer a call once (one aborted or answered meanwhile keeps its first answer)."""
    try:
        future.set_exception(exc) if exc is not None else future.set_result(result)
    except InvalidStateError:
        pass


def _first_token_result(out: RequestOutput) -> PrefillResult:
    m = out.metrics
    completion = out.outputs[0]
    logprob = None
    if completion.logprobs:
        logprob = completion.logprobs[0].get(completion.token_ids[0])
    return PrefillResult(
        request_id=out.request_id,
        token_id=completion.token_ids[0],
        text=completion.text,
        logprob=logprob,
        finished=completion.finish_reason is not None,
        finish_reason=completion.finish_reason,
        num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens,
        queue_s=m.queue_seconds(),
        prefill_s=m.prefill_seconds(time.perf_counter()),
    )
