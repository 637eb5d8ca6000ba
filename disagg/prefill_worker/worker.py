"""A prefill instance: an engine in the PREFILL role whose KV streams to decode workers.

Plain Python; the Ray actor wraps it. A request starts before the decode side has answered the
handshake, so each request is a polled state machine:

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
from concurrent.futures import Future
from dataclasses import dataclass, field

from disagg.config import EngineConfig, Role
from disagg.engine.distributed import InstanceGroups
from disagg.engine.engine import LLMEngine
from disagg.engine.outputs import RequestOutput
from disagg.kv_transfer.connector import assemble, instance_kv_layout
from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVLayout, KVTarget, targets_for
from disagg.kv_transfer.tally import TransferTally
from disagg.kv_transfer.transport import Transport
from disagg.request import SamplingParams
from disagg.rpc.messages import Reservation
from disagg.worker.shard_group import ShardGroup

logger = logging.getLogger(__name__)


class PrefillState(enum.Enum):
    AWAITING_TARGETS = "awaiting_targets"  # computing (or done), the handshake's answer pending
    STREAMING = "streaming"  # targets in force: layers go out as computed
    AWAITING_ACK = "awaiting_ack"  # first token sent with the DONE; waiting for every rank's ACK
    DONE = "done"
    FAILED = "failed"


@dataclass
class _Prefill:
    deadline: float  # for the targets to come
    state: PrefillState = PrefillState.AWAITING_TARGETS
    first_token: int | None = None  # set when the prompt finished before the targets came


@dataclass
class _TargetsArrival:
    request_id: str
    reservation: Reservation
    deadline: float  # for its request to be there (the targets may overtake its add_request)
    done: Future = field(default_factory=Future)


class PrefillWorker:
    def __init__(
        self,
        config: EngineConfig,
        transport: Transport,
        *,
        kv_timeout: float,
        groups: InstanceGroups | None = None,
        followers: ShardGroup | None = None,
        engine: LLMEngine | None = None,
    ):
        """`groups`, `followers`: rank 0 of a TP x PP instance (its process groups, the other ranks).
        `engine`: an idle engine to take over, switched to PREFILL (disagg.worker.role_switch)."""
        built = assemble(
            config,
            Role.PREFILL,
            kv_timeout=kv_timeout,
            transport=transport,
            groups=groups,
            followers=followers,
            engine=engine,
        )
        self.engine, self.sender = built.engine, built.endpoint
        self.followers = followers
        self.kv_timeout = kv_timeout
        self.tally = TransferTally()  # a request's KV is delivered when every rank's slice is
        self._prefills: dict[str, _Prefill] = {}
        self._arrivals: deque[_TargetsArrival] = deque()  # from link threads, taken on the engine thread
        self._unmatched: dict[str, _TargetsArrival] = {}  # came before their request: applied when it is added
        self.transfer_results: list[TransferResult] = []  # the latest step's, for metrics
        self._layout: KVLayout | None = None

    def address(self) -> str:
        return self.sender.address()

    def kv_layout(self) -> KVLayout:
        """Every rank's KV endpoint; fixed once the other ranks joined (before serving)."""
        if self._layout is None:
            self._layout = instance_kv_layout(
                self.engine.config, self.sender, self.followers.kv_ranks if self.followers is not None else []
            )
        return self._layout

    # ---- requests (engine thread, except set_kv_targets) ---------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, priority: int = 0
    ) -> None:
        """Queue the prefill (by `priority`); its KV waits here for `set_kv_targets` (at most the kv timeout)."""
        self.engine.add_request(
            request_id, prompt_token_ids=prompt_token_ids, sampling_params=sampling_params, priority=priority
        )
        self._prefills[request_id] = _Prefill(time.monotonic() + self.kv_timeout)

    def set_kv_targets(self, request_id: str, reservation: Reservation) -> Future:
        """Where the request's KV goes (the decode instance's reservation). Callable from any
        thread, also while the request's step runs; the Future resolves on the engine thread:
        True once the targets are in force, False if the request is gone."""
        arrival = _TargetsArrival(request_id, reservation, time.monotonic() + self.kv_timeout)
        self.sender.add_later(request_id, lambda: self._own_targets(request_id, reservation))
        self._arrivals.append(arrival)
        return arrival.done

    def abort(self, request_id: str) -> bool:
        self._prefills.pop(request_id, None)
        unmatched = self._unmatched.pop(request_id, None)
        if unmatched is not None:
            unmatched.done.set_result(False)
        self._abort_transfers(request_id)
        found = self.engine.abort_request(request_id)
        self.engine.release_kv(request_id)
        return found

    # ---- the loop ------------------------------------------------------------------------------------
    def needs_sync(self) -> bool:
        """A step is due although nothing computes: targets to apply, the other ranks have commands
        to receive or transfers under way, or a request waited too long for its targets."""
        now = time.monotonic()
        if (
            self._arrivals
            or any(now > p.deadline for p in self._awaiting_targets())
            or any(now > a.deadline for a in self._unmatched.values())
        ):
            return True
        return self.followers is not None and (self.followers.has_commands() or self.tally.has_pending)

    def step(self) -> list[RequestOutput]:
        """One engine step; first tokens go out with DONE; acknowledged blocks are freed."""
        self._apply_arrivals()  # before the step: the other ranks get their targets with it
        scheduler = self.engine.scheduler
        computes = bool(scheduler.running or scheduler.waiting)
        outputs = self.engine.step()
        for out in outputs:
            if out.error is not None:  # the engine ended it: drop its transfer state too
                self.abort(out.request_id)
            elif out.finished:
                self._prompt_done(out.request_id, out.outputs[0].token_ids[0])
        self._apply_arrivals()
        self._expire_awaiting_targets()
        self.transfer_results = self._finished_transfers(computes)
        for result in self.transfer_results:
            self._transfer_finished(result)
        return outputs

    def is_idle(self) -> bool:
        """No request left to compute and no blocks held for a transfer."""
        return not self.engine.has_unfinished_requests() and not self.engine.scheduler.held_for_export

    def kv_paths(self) -> dict[str, str]:
        """Peer id -> how KV goes to it, for this rank's pairs so far (`disagg status`)."""
        return self.sender.transport.paths()

    def close(self) -> None:
        self.sender.close()

    # ---- state transitions ---------------------------------------------------------------------------
    def _prompt_done(self, request_id: str, first_token: int) -> None:
        prefill = self._prefills.get(request_id)
        if prefill is None:  # nobody to send the KV to: nothing to hold it for
            self.engine.release_kv(request_id)
            return
        prefill.first_token = first_token
        if prefill.state is PrefillState.STREAMING:  # else the KV waits here for its targets
            self._finish_transfer(request_id, prefill)

    def _apply_arrivals(self) -> None:
        """Targets in force for the requests they came for; those that came before their request
        wait for it (the request link may hand them over before the engine thread added it)."""
        if not (self._arrivals or self._unmatched):
            return
        self.sender.add_deferred()
        while self._arrivals:
            arrival = self._arrivals.popleft()
            self._unmatched[arrival.request_id] = arrival
        now = time.monotonic()
        for request_id, arrival in list(self._unmatched.items()):
            if request_id in self._prefills:
                del self._unmatched[request_id]
                arrival.done.set_result(self._start_streaming(request_id, arrival.reservation))
            elif now > arrival.deadline:  # its request is gone (or never came)
                del self._unmatched[request_id]
                arrival.done.set_result(False)

    def _start_streaming(self, request_id: str, reservation: Reservation) -> bool:
        prefill = self._prefills[request_id]
        request = self.engine.scheduler.requests.get(request_id)
        if request is None or prefill.state is not PrefillState.AWAITING_TARGETS:
            return False
        self.sender.add(
            request_id, self._targets(self.kv_layout().ranks[0], reservation)
        )  # (a no-op if add_deferred did it)
        self._register_follower_targets(request_id, reservation)
        prefill.state = PrefillState.STREAMING
        if prefill.first_token is not None:  # the prompt is done: send what has not gone out, then DONE
            self.sender.catch_up(request_id, request.block_ids, request.num_computed_tokens)
            if self.followers is not None:
                self.followers.catch_up(request_id, request.block_ids, request.num_computed_tokens)
            self._finish_transfer(request_id, prefill)
        return True  # otherwise the next steps stream it, every rank the layers it computed before first

    def _finish_transfer(self, request_id: str, prefill: _Prefill) -> None:
        prefill.state = PrefillState.AWAITING_ACK
        self.sender.finish(request_id, prefill.first_token)
        if self.followers is not None:
            self.followers.finish_transfer(request_id)

    def _transfer_finished(self, result: TransferResult) -> None:
        prefill = self._prefills.pop(result.request_id, None)
        if prefill is not None:
            prefill.state = PrefillState.DONE if result.ok else PrefillState.FAILED
        if result.ok:
            self.engine.release_kv(result.request_id)
            return
        if self.followers is not None:  # the prompt may still be computing: stop it too, wherever it is
            self.followers.abort_transfers(result.request_id)
        self.engine.abort_request(result.request_id)

    def _expire_awaiting_targets(self) -> None:
        now = time.monotonic()
        for request_id in [
            r for r, p in self._prefills.items() if p.state is PrefillState.AWAITING_TARGETS and now > p.deadline
        ]:
            logger.warning("request %s: no KV targets arrived in time; dropping it", request_id)
            self.abort(request_id)

    def _awaiting_targets(self) -> list[_Prefill]:
        return [p for p in self._prefills.values() if p.state is PrefillState.AWAITING_TARGETS]

    # ---- targets -------------------------------------------------------------------------------------
    def _own_targets(self, request_id: str, reservation: Reservation) -> list[KVTarget] | None:
        """This rank's targets, if the request still awaits them (engine thread, mid-step too)."""
        prefill = self._prefills.get(request_id)
        if prefill is None or prefill.state is not PrefillState.AWAITING_TARGETS:
            return None
        return self._targets(self.kv_layout().ranks[0], reservation)

    def _register_follower_targets(self, request_id: str, reservation: Reservation) -> None:
        layout = self.kv_layout()
        for index, rank in enumerate(layout.ranks[1:]):  # delivered with the next step, before it computes
            self.followers.add_targets(index, request_id, self._targets(rank, reservation))
        self.tally.expect(request_id, len(layout.ranks))

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
        self.tally.forget(request_id)

    def _finished_transfers(self, computed: bool) -> list[TransferResult]:
        results = self.sender.poll()
        if self.followers is not None:
            if self.followers.has_commands() or (self.tally.has_pending and not computed):
                self.followers.sync()
            results += self.followers.take_results()
        return self.tally.add(results)
