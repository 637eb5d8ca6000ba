"""A prefill instance: an engine in the PREFILL role whose KV streams to decode workers.

Plain Python; the Ray actor wraps it. Each request arrives with its KV targets (the decode
side's answer to the handshake). Layers stream out as the engine computes them; after the
first token the DONE goes out, and the request's blocks are freed on the decode side's
acknowledgement, or when the transfer fails or times out.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from disagg.config import EngineConfig, Role
from disagg.engine.engine import LLMEngine
from disagg.engine.outputs import RequestOutput
from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVTarget
from disagg.kv_transfer.sender import KVSender
from disagg.kv_transfer.transport import Transport
from disagg.engine.distributed import InstanceGroups
from disagg.kv_transfer.layout import KVLayout, targets_for
from disagg.kv_transfer.tally import TransferTally
from disagg.request import SamplingParams
from disagg.rpc.messages import Reservation


logger = logging.getLogger(__name__)


@dataclass
class _AwaitingTargets:
    deadline: float
    first_token: int | None = None  # set when the prompt finished before the targets came


class PrefillWorker:
    def __init__(self, config: EngineConfig, transport: Transport, kv_timeout: float = 30.0, groups: InstanceGroups | None = None, followers=None):
        """`groups`, `followers`: rank 0 of a TP x PP instance (disagg.worker.shard_group.ShardGroup)."""
        self.engine = LLMEngine(config.replace(role=Role.PREFILL), groups=groups)
        self.engine.runner.followers = followers
        self.followers = followers
        self.transport = transport
        self.sender = KVSender(transport, self.engine.kv_cache, timeout=kv_timeout)  # rank 0: layer 0, head 0 on
        self.engine.runner.on_layer = self._on_layer
        self.engine.runner.on_forward_done = self.sender.on_step_end
        self.tally = TransferTally()  # a request's KV is delivered when every rank's slice is
        self._awaiting_targets: dict[str, _AwaitingTargets] = {}  # started early, handshake pending
        self._queued_targets: deque = deque()  # (request_id, reservation, layout) from link threads
        self.transfer_results: list[TransferResult] = []  # the latest step's, for metrics

    def address(self) -> str:
        return self.transport.address()

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, targets: list[KVTarget]) -> None:
        # Register the transfer first: the very first step may already stream layers.
        if targets:
            self.sender.add(request_id, targets)
            self.tally.expect(request_id, 1)
        self._add(request_id, prompt_token_ids, sampling_params)

    def add_request_for(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, reservation: Reservation, layout: KVLayout) -> None:
        """Prefill for a decode instance of any parallel plan: each rank of this instance
        (`layout`) streams its slice to the decode ranks that need it (the resharding map)."""
        self._register_targets(request_id, reservation, layout)
        self._add(request_id, prompt_token_ids, sampling_params)

    def add_request_early(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, targets_timeout: float) -> None:
        """Start the prefill before the decode side has answered the handshake: the KV stays in
        this instance's blocks until `set_targets` says where it goes (then what is computed by
        then is sent at once, the rest as it is computed). Without targets within
        `targets_timeout` seconds the request is dropped and its blocks freed."""
        self._add(request_id, prompt_token_ids, sampling_params)
        self._awaiting_targets[request_id] = _AwaitingTargets(time.monotonic() + targets_timeout)

    def queue_targets(self, request_id: str, reservation: Reservation, layout: KVLayout) -> None:
        """The part of `set_targets` that may be called from any thread, also while the request's
        step runs: the engine thread registers this rank's targets before the next layer's KV goes
        out (the layers computed before go first), instead of after the step. The caller only
        queues them: work on its thread would take the GIL from the computing engine thread."""
        self._queued_targets.append((request_id, reservation, layout))

    def _on_layer(self, local_layer: int, chunks) -> None:
        if self._queued_targets:  # (checked here: a call per layer costs, see KVSender.on_layer)
            self._register_queued_targets()
        self.sender.on_layer(local_layer, chunks)

    def _register_queued_targets(self) -> None:
        while self._queued_targets:
            self.add_targets_now(*self._queued_targets.popleft())

    def add_targets_now(self, request_id: str, reservation: Reservation, layout: KVLayout) -> None:
        """This rank's sender learns the targets of a request started early (safe from any thread)."""
        if request_id not in self._awaiting_targets:
            return
        cfg = self.engine.model_config
        own = next(r for r in layout.ranks if r.peer_id == self.sender.worker_id)
        self.sender.add(request_id, targets_for(own.place, layout.plan, reservation.layout, reservation.transfer_ids, reservation.block_ids, cfg.num_hidden_layers, cfg.num_key_value_heads))

    def set_targets(self, request_id: str, reservation: Reservation, layout: KVLayout) -> bool:
        """The handshake's answer for a request started early; False if it is gone (aborted)."""
        self._register_queued_targets()  # (engine thread: none may be left behind for later)
        waiting = self._awaiting_targets.pop(request_id, None)
        request = self.engine.scheduler.requests.get(request_id)
        if waiting is None or request is None:
            self.sender.abort(request_id)  # targets that add_targets_now may have registered
            return False
        self._register_targets(request_id, reservation, layout)  # (this rank's own: already there, or now)
        if waiting.first_token is not None:  # the prompt is done: send what has not gone out, then DONE
            self.sender.catch_up(request_id, request.block_ids, request.num_computed_tokens)
            if self.followers is not None:
                self.followers.command_all("catch_up", request_id, list(request.block_ids), request.num_computed_tokens)
            self._finish_transfer(request_id, waiting.first_token)
        # Otherwise the next steps stream it: every rank sends the layers it computed before first.
        return True

    def _register_targets(self, request_id: str, reservation: Reservation, layout: KVLayout) -> None:
        cfg = self.engine.model_config
        follower_ids = [r.peer_id for r in self.followers.kv_ranks] if self.followers is not None else []
        for rank in layout.ranks:
            targets = targets_for(rank.place, layout.plan, reservation.layout, reservation.transfer_ids, reservation.block_ids, cfg.num_hidden_layers, cfg.num_key_value_heads)
            if rank.peer_id == self.sender.worker_id:
                self.sender.add(request_id, targets)
            else:  # delivered with the next step, before it computes anything
                self.followers.command(follower_ids.index(rank.peer_id), "add", request_id, targets)
        self.tally.expect(request_id, len(layout.ranks))

    def _finish_transfer(self, request_id: str, first_token: int) -> None:
        self.sender.finish(request_id, first_token)
        if self.followers is not None:
            self.followers.command_all("finish", request_id)

    def _add(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        try:
            self.engine.add_request(request_id, prompt_token_ids=prompt_token_ids, sampling_params=sampling_params)
        except Exception:
            self._abort_transfers(request_id)
            self.sender.poll()
            raise

    def _expire_awaiting_targets(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, w in self._awaiting_targets.items() if now > w.deadline]:
            logger.warning("request %s: no KV targets arrived in time; dropping it", request_id)
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._awaiting_targets.pop(request_id, None)
        self._abort_transfers(request_id)
        self.engine.abort_request(request_id)
        self.engine.release_kv(request_id)

    def _abort_transfers(self, request_id: str) -> None:
        self.sender.abort(request_id)
        if self.followers is not None:
            self.followers.call_all("abort", request_id)
        self.tally.forget(request_id)

    def needs_sync(self) -> bool:
        """A step is due although nothing computes: the other ranks have commands to receive or
        transfers under way, or a request waited too long for its targets."""
        if any(time.monotonic() > w.deadline for w in self._awaiting_targets.values()):
            return True
        return self.followers is not None and (self.followers.has_commands() or self.tally.has_pending)

    def step(self) -> list[RequestOutput]:
        """One engine step; first tokens go out with DONE; acknowledged blocks are freed."""
        scheduler = self.engine.scheduler
        computes = bool(scheduler.running or scheduler.waiting)
        outputs = self.engine.step()
        for out in outputs:
            if not out.finished:
                continue
            if out.request_id in self._awaiting_targets:  # hold the KV until set_targets
                self._awaiting_targets[out.request_id].first_token = out.outputs[0].token_ids[0]
            elif self.sender.has_transfer(out.request_id):
                self._finish_transfer(out.request_id, out.outputs[0].token_ids[0])
            else:  # nobody to send the KV to: nothing to hold it for
                self.engine.release_kv(out.request_id)
        self._expire_awaiting_targets()
        self.transfer_results = self._finished_transfers(computes)
        for result in self.transfer_results:
            if result.ok:
                self.engine.release_kv(result.request_id)
            else:  # the prompt may still be computing: stop it too, wherever it is
                if self.followers is not None:
                    self.followers.call_all("abort", result.request_id)
                self.engine.abort_request(result.request_id)
        return outputs

    def _finished_transfers(self, computed: bool) -> list[TransferResult]:
        results = self.sender.poll()
        if self.followers is not None:
            if self.followers.has_commands() or (self.tally.has_pending and not computed):
                self.followers.sync()
            results += self.followers.take_results()
        return self.tally.add(results)

    def is_idle(self) -> bool:
        """No request left to compute and no blocks held for a transfer."""
        return not self.engine.has_unfinished_requests() and not self.engine.scheduler.held_for_export

    def close(self) -> None:
        self.sender.close()
