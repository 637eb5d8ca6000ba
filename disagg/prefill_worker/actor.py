"""The prefill instance as a Ray actor, serving PrefillService (disagg.rpc.services).

`prefill`'s reply is the first token (that is the request's TTFT) and is sent by the engine
thread as soon as the token exists; the KV keeps streaming to the decode worker in the
background and the blocks are freed on its ack.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from disagg.worker.actor_base import WorkerActorBase, engine_load
from disagg.config import Role, WorkerConfig
from disagg.errors import KVTransferError, RequestFailedError
from disagg.kv_transfer.factory import make_transport
from disagg.prefill_worker.worker import PrefillWorker
from disagg.registry import LoadReport
from disagg.request import SamplingParams
from disagg.rpc.server import Link
from disagg.rpc.messages import PrefillResult, Reservation
from disagg.rpc.services import PrefillService


@dataclass(frozen=True)
class StartPrefill:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int


@dataclass(frozen=True)
class AbortPrefill:
    request_id: str


class PrefillActor(WorkerActorBase, PrefillService):
    role = "prefill"
    service = PrefillService

    def __init__(self, config: WorkerConfig, followers=None):
        """`followers`: [(RankPlace, ShardActor handle)] of the other ranks of a TP x PP instance."""
        if config.role is not Role.PREFILL:
            raise ValueError(f"role: a prefill actor runs the prefill role, not {config.role}")
        super().__init__(config)
        groups, wait_for_ranks = self._start_ranks(followers)
        transport = make_transport(
            config.kv_transport, self.instance_id, config.link_key, self.host, config.engine.device
        )
        self.worker = PrefillWorker(
            config.engine, transport, kv_timeout=config.kv_timeout_s, groups=groups, followers=self.shards
        )
        if wait_for_ranks is not None:
            wait_for_ranks()
        self._attach_prefill_worker()
        self._start()

    def _attach_prefill_worker(self) -> None:
        """The actor's state for `self.worker` (a new one, after a role switch, too)."""
        self.worker.sender.on_finished = self.loop.wake
        # request id -> (its first token, the link that asked); set on link threads, completed on the engine thread
        self._first_tokens: dict[str, tuple[Future, Link]] = {}

    def load(self) -> LoadReport:
        return engine_load(self.worker.engine)

    async def status(self) -> dict:
        return {"load": self.load(), "kv_bytes_sent": self.worker.sender.num_bytes_total}

    # ---- PrefillService (on the link's thread) -------------------------------------------------
    def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> Future:
        first_token: Future = Future()
        self._first_tokens[request_id] = (first_token, self.rpc.caller())
        try:
            added = self.loop.submit(StartPrefill(request_id, prompt_token_ids, params, priority))
        except BaseException:
            self._first_tokens.pop(request_id, None)
            raise
        added.add_done_callback(lambda f: f.exception() is not None and self._reject(request_id, f.exception()))
        return first_token

    def set_kv_targets(self, request_id: str, reservation: Reservation) -> Future:
        """This rank's sender learns the targets before the next layer (the request's step may be
        running); the rest waits for the engine thread."""
        done = self.worker.set_kv_targets(request_id, reservation)
        self.loop.wake()
        return done

    def abort(self, request_id: str) -> Future:
        waiting = self._first_tokens.pop(request_id, None)
        if waiting is not None:
            waiting[0].cancel()
        return self.loop.submit(AbortPrefill(request_id))

    def _link_closed(self, link: Link) -> None:
        for request_id, (_, asked_by) in list(self._first_tokens.items()):
            if asked_by is link:
                self.abort(request_id)

    # ---- engine thread -------------------------------------------------------------------------
    def _engine_commands(self) -> dict:
        return {StartPrefill: self._start_prefill, AbortPrefill: self._abort}

    def _start_prefill(self, command: StartPrefill) -> None:
        self.worker.add_request(command.request_id, command.prompt_token_ids, command.params, command.priority)

    def _abort(self, command: AbortPrefill) -> bool:
        return self.worker.abort(command.request_id)

    def _kv_endpoint(self):
        return self.worker.sender

    def _handle_outputs(self, outputs) -> None:
        for out in outputs:
            if out.error is not None:
                self._reject(out.request_id, RequestFailedError(f"prefill step failed on this request: {out.error}"))
            elif out.finished:
                self._resolve(out.request_id, _first_token_result(out))
        for result in self.worker.transfer_results:
            if not result.ok:  # failed before the first token went out: the caller must know
                self._reject(result.request_id, KVTransferError(result.error or "KV transfer failed"))

    def _fail_all(self, exc: Exception) -> None:
        engine = self.worker.engine
        for request_id in list(engine.scheduler.requests):
            self.worker.abort(request_id)
            self._reject(request_id, RuntimeError(f"prefill step failed: {exc}"))

    def _resolve(self, request_id: str, result: PrefillResult) -> None:
        waiting = self._first_tokens.pop(request_id, None)
        if waiting is not None:
            try:
                waiting[0].set_result(result)  # its link sends the reply from this thread, now
            except InvalidStateError:
                pass  # aborted meanwhile

    def _reject(self, request_id: str, exc: BaseException) -> None:
        waiting = self._first_tokens.pop(request_id, None)
        if waiting is not None:
            try:
                waiting[0].set_exception(exc)
            except InvalidStateError:
                pass


def _first_token_result(out) -> PrefillResult:
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
