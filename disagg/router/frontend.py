"""The gRPC frontend (grpc.aio): validates, tokenizes, runs the request through the
orchestrator and streams its tokens; plus Abort, ClusterStatus, health checking and reflection.

Each response message carries one engine step's tokens of the request. Errors map to status
codes in one place (disagg.errors): bad input INVALID_ARGUMENT, overload RESOURCE_EXHAUSTED,
no worker UNAVAILABLE, deadline DEADLINE_EXCEEDED, cancel CANCELLED.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid

import grpc

from disagg.errors import DisaggError, InvalidRequestError, grpc_code_name
from disagg.metrics import ServingMetrics
from disagg.placement.policies import Slo
from disagg.router.directory import InstanceDirectory
from disagg.router.grpc_service import Undecodable
from disagg.router.orchestrator import Orchestrator
from disagg.router.records import RequestRecords
from disagg.router.replanning import LoggedDecision, ReplanLoop
from disagg.router.validation import (
    PRIORITY_NAMES,
    check_priority,
    check_request_id,
    check_slo,
    ModelLimits,
    check_fits,
    check_model_bounds,
    check_text_size,
    prompt_token_ids,
    sampling_params,
)
from disagg.v1 import serving_pb2, serving_pb2_grpc
from disagg.rpc.messages import TokenDelta

logger = logging.getLogger(__name__)


class ServingServicer(serving_pb2_grpc.ServingServicer):
    def __init__(
        self,
        orchestrator: Orchestrator,
        directory: InstanceDirectory,
        tokenizer,
        limits: ModelLimits,
        metrics: ServingMetrics,
        records: RequestRecords | None,
        model_name: str,
    ):
        self.orchestrator = orchestrator
        self.directory = directory
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics
        self.records = records
        self.model_name = model_name
        self.max_inflight = orchestrator.config.inflight_limit()
        self.api_key = orchestrator.config.api_key
        self._active: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()  # ended by the Abort RPC: their streams end with finish_reason "abort"
        self.draining = False
        self.replanning: ReplanLoop | None = None  # the server sets it when its instances may switch

    # ---- Generate --------------------------------------------------------------------------------
    async def Generate(self, request, context):
        received_at = time.monotonic()  # the client's TTFT starts about here: what the router's predictions aim at
        await self._admit(context)
        await self._refuse_undecodable(request, context)
        request_id = request.request_id or uuid.uuid4().hex
        try:
            check_request_id(request_id)
        except InvalidRequestError as exc:
            await self._invalid(context, exc)
        if request_id in self._active:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {request_id!r} is already in flight")
        # Counted against admission from here on, with no await since the check: tokenizing
        # (below, on a thread) must not let more requests in than the bound.
        self._active[request_id] = asyncio.current_task()
        try:
            check_slo(request.slo)
            check_priority(request.priority)
            prompt_ids, params = await self._parse(request)
        except BaseException as exc:
            self._active.pop(request_id, None)
            if isinstance(exc, InvalidRequestError):
                await self._invalid(context, exc)
            raise
        stream = _StreamStats(time.perf_counter(), len(prompt_ids))
        # The response headers go out while the prompt computes, so that at the first token only
        # its message is left to send: one write and one wake-up of the client fewer on the TTFT
        # path.
        headers = asyncio.ensure_future(context.send_initial_metadata(()))
        headers.add_done_callback(_retrieve)
        deltas = self.orchestrator.generate(request_id, prompt_ids, params, *self._demand(request), received_at)
        try:
            async for delta in deltas:
                if request_id in self._aborted:
                    # Abort's cancel can be lost (it may land while gRPC writes, outside this
                    # generator): the next delta ends the stream instead.
                    raise asyncio.CancelledError
                await headers  # done long before: a prompt takes milliseconds at least
                yield stream.response(request_id, delta)
        except asyncio.CancelledError:
            await deltas.aclose()  # the attempt's cleanup (aborts on the workers) runs now
            self._active.pop(request_id, None)  # no longer counts against admission, whatever cleanup is left
            if request_id not in self._aborted:
                self.metrics.observe_failure("CANCELLED")
                raise
            # Ended by Abort: the client's stream ends now, with a last message saying so.
            self._aborted.discard(request_id)
            yield stream.response(request_id, TokenDelta(request_id, [], finished=True, finish_reason="abort"))
        except (DisaggError, asyncio.TimeoutError) as exc:
            code = "DEADLINE_EXCEEDED" if isinstance(exc, asyncio.TimeoutError) else grpc_code_name(exc)
            self.metrics.observe_failure(code)
            await asyncio.wait([headers])  # the status follows the headers, never races them
            await context.abort(getattr(grpc.StatusCode, code), str(exc) or type(exc).__name__)
        except (ValueError, ArithmeticError) as exc:
            # Bad input was refused above as InvalidRequestError (or by a worker, as RemoteError):
            # this is the router's own bug, and the client must not be told it sent garbage.
            logger.exception("request %s failed inside the router", request_id)
            self.metrics.observe_failure("INTERNAL")
            await asyncio.wait([headers])
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        except Exception as exc:  # a worker died mid-request (RayActorError and friends)
            if context.cancelled():  # no: the client went away (before the headers went out, say)
                self.metrics.observe_failure("CANCELLED")
                return
            logger.exception("request %s failed", request_id)
            self.metrics.observe_failure("UNAVAILABLE")
            await asyncio.wait([headers])
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker failed: {type(exc).__name__}: {exc}")
        finally:
            self._active.pop(request_id, None)
            self._aborted.discard(request_id)  # an Abort that came as the stream ended must not outlive it
        self._record(request_id, stream)

    def _demand(self, request) -> tuple[Slo, str]:
        """The request's SLO (each target 0: the server's) and priority."""
        default = self.orchestrator.default_slo
        slo = Slo(request.slo.ttft_ms or default.ttft_ms, request.slo.tpot_ms or default.tpot_ms)
        return slo, PRIORITY_NAMES.get(request.priority, "standard")

    async def _admit(self, context) -> None:
        await self._check_key(context)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        if len(self._active) >= self.max_inflight:
            self.metrics.observe_failure("RESOURCE_EXHAUSTED")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_inflight} requests in flight; try again later"
            )

    async def _parse(self, request) -> tuple[list[int], object]:
        params = sampling_params(request.sampling, self.tokenizer)
        check_model_bounds(params, self.limits)
        check_text_size(request, self.limits)
        # Tokenizing grows with the text: off the event loop that streams everyone's tokens.
        ids = await asyncio.to_thread(prompt_token_ids, request, self.tokenizer, self.limits.vocab_size)
        check_fits(len(ids), params, self.limits)
        return ids, params

    def _record(self, request_id: str, stream: "_StreamStats") -> None:
        if stream.final is None:
            return
        t = stream.final.timings
        self.metrics.observe_finished(
            t.ttft_s,
            t.e2e_s,
            stream.itl,
            t.queue_s,
            t.prefill_s,
            t.decode_s,
            stream.final.usage.prompt_tokens,
            stream.final.usage.completion_tokens,
            stream.final.finish_reason,
        )
        if t.transfer_s:
            self.metrics.observe_transfer(t.transfer_s, stream.transfer_bytes)
        if self.records is not None:
            self.records.add(
                {
                    "request_id": request_id,
                    "finish_reason": stream.final.finish_reason,
                    "prompt_tokens": stream.final.usage.prompt_tokens,
                    "completion_tokens": stream.final.usage.completion_tokens,
                    "ttft_s": t.ttft_s,
                    "e2e_s": t.e2e_s,
                    "queue_s": t.queue_s,
                    "prefill_s": t.prefill_s,
                    "transfer_s": t.transfer_s,
                    "decode_s": t.decode_s,
                }
            )

    # ---- Abort, ClusterStatus --------------------------------------------------------------------
    async def Abort(self, request, context):
        await self._check_key(context)
        await self._refuse_undecodable(request, context)
        task = self._active.get(request.request_id)
        if task is not None:
            self._aborted.add(request.request_id)
            task.cancel()
        return serving_pb2.AbortResponse(found=task is not None)

    async def ClusterStatus(self, request, context):
        await self._check_key(context)
        await self._refuse_undecodable(request, context)
        pools: dict[str, list] = {}
        slo = self.orchestrator.default_slo
        for inst in sorted(self.directory.all(), key=lambda i: i.instance_id):
            load, info = inst.view.load, inst.view.info
            pools.setdefault(inst.role, []).append(
                serving_pb2.Instance(
                    instance_id=inst.instance_id,
                    role=inst.role,
                    kv_address=info.kv_address,
                    healthy=True,
                    num_running=load.num_running,
                    num_waiting=load.num_waiting,
                    kv_cache_usage=load.kv_cache_usage,
                    tensor_parallel_size=info.tensor_parallel_size,
                    pipeline_parallel_size=info.pipeline_parallel_size,
                    heartbeat_age_s=inst.view.heartbeat_age_s,
                    num_free_blocks=load.num_free_blocks,
                    num_total_blocks=load.num_total_blocks,
                    latency_model=_latency_model(inst),
                )
            )
            self.metrics.set_instance_load(
                inst.instance_id, inst.role, load.num_running, load.num_waiting, load.kv_cache_usage
            )
        return serving_pb2.ClusterStatusResponse(
            pools=[serving_pb2.Pool(role=r, instances=i) for r, i in pools.items()],
            model=self.model_name,
            mode=self.orchestrator.config.mode,
            default_slo=serving_pb2.Slo(ttft_ms=slo.ttft_ms, tpot_ms=slo.tpot_ms),
            replan=self.replanning is not None,
            replan_decisions=[_replan_decision(e) for e in reversed(self.replanning.log)] if self.replanning else [],
        )

    async def _check_key(self, context) -> None:
        if not self.api_key:
            return
        given = dict(context.invocation_metadata()).get("x-api-key", "")
        # Constant time: how long a refusal takes says nothing about how much of the key matched.
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong x-api-key")

    async def _invalid(self, context, exc: InvalidRequestError) -> None:
        self.metrics.observe_failure("INVALID_ARGUMENT")
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _refuse_undecodable(self, request, context) -> None:
        if isinstance(request, Undecodable):
            self.metrics.observe_failure("INVALID_ARGUMENT")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request could not be decoded: {request.reason}")

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; give those in flight `timeout_s` to finish, then cancel them."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self._active.values()):
            task.cancel()


class _StreamStats:
    """Builds the response messages of one stream and keeps what the final one reports."""

    def __init__(self, started: float, num_prompt_tokens: int):
        self.started = started
        self.num_prompt_tokens = num_prompt_tokens
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.itl: list[float] = []
        self.completion_tokens = 0
        self.prefill_s = self.queue_s = self.transfer_s = 0.0
        self.transfer_bytes = 0
        self.cached = 0
        self.final: serving_pb2.GenerateResponse | None = None

    def response(self, request_id: str, delta: TokenDelta) -> serving_pb2.GenerateResponse:
        now = time.perf_counter()
        if delta.token_ids:
            if self.first_token_at is None:
                self.first_token_at = now
                self.prefill_s, self.cached = delta.prefill_s, delta.num_cached_tokens
            elif self.last_token_at is not None:
                self.itl.append((now - self.last_token_at) / len(delta.token_ids))
            self.last_token_at = now
        self.completion_tokens += len(delta.token_ids)
        self.transfer_s = delta.transfer_s or self.transfer_s
        self.transfer_bytes = delta.transfer_bytes or self.transfer_bytes
        msg = serving_pb2.GenerateResponse(
            request_id=request_id,
            token_ids=delta.token_ids,
            text=delta.text,
            logprobs=delta.logprobs,
            finished=delta.finished,
        )
        if delta.finished:
            msg.finish_reason = delta.finish_reason or "stop"
            msg.usage.CopyFrom(
                serving_pb2.Usage(
                    prompt_tokens=self.num_prompt_tokens,
                    completion_tokens=self.completion_tokens,
                    cached_prompt_tokens=self.cached,
                )
            )
            ttft = (self.first_token_at or now) - self.started
            msg.timings.CopyFrom(
                serving_pb2.Timings(
                    queue_s=max(0.0, ttft - self.prefill_s),
                    prefill_s=self.prefill_s,
                    transfer_s=self.transfer_s,
                    decode_s=now - (self.first_token_at or now),
                    ttft_s=ttft,
                    e2e_s=now - self.started,
                    prefill_instance=delta.prefill_instance,
                    decode_instance=delta.decode_instance,
                    predicted_ttft_s=delta.predicted_ttft_s,
                    predicted_tpot_s=delta.predicted_tpot_s,
                )
            )
            self.final = msg
        return msg


def _retrieve(task: asyncio.Future) -> None:
    """Consume the outcome of a task nobody may await (a cancelled request's headers)."""
    if not task.cancelled():
        task.exception()


def _latency_model(inst) -> serving_pb2.LatencyModel:
    model, online = inst.step_model, inst.online
    kind = "prefill" if inst.role == "prefill" else "decode"
    return serving_pb2.LatencyModel(
        prefill=model.prefill.to_list(),
        decode=model.decode_small.to_list(),
        recent_error=online.recent_error() or 0.0,
        num_steps=online.num_samples,
        calibrated=online.calibrated(kind),
    )


def _replan_decision(entry: LoggedDecision) -> serving_pb2.ReplanDecision:
    decision, switch = entry.decision, entry.switch
    return serving_pb2.ReplanDecision(
        unix_time=entry.at,
        current=str(decision.current),
        best=str(decision.best),
        predicted_gain=decision.gain,
        reason=decision.reason,
        switched_instance=switch.instance_id if switch else "",
        switch_outcome=switch.outcome if switch else "",
        switch_seconds=switch.seconds if switch else 0.0,
    )
