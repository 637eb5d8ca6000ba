"""The gRPC frontend (grpc.aio): runs each `Generate` through the request path
(disagg.router.request_path: admission, validation, the orchestrator, metrics, records) and
streams its tokens; plus Abort, ClusterStatus, health checking and reflection.

Each response message carries one engine step's tokens of the request. Errors map to status
codes in one place (disagg.errors): bad input INVALID_ARGUMENT, overload RESOURCE_EXHAUSTED,
no worker UNAVAILABLE, deadline DEADLINE_EXCEEDED, cancel CANCELLED.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from disagg.errors import DisaggError, InvalidRequestError, grpc_code_name
from disagg.router.directory import InstanceDirectory
from disagg.router.grpc_service import Undecodable
from disagg.router.kv_tier_status import flat_kv_tiers
from disagg.router.key_guard import given_key
from disagg.router.replanning import LoggedDecision, ReplanView
from disagg.router.request_path import RequestFailed, RequestPath
from disagg.router.stream_stats import Outcome
from disagg.rpc.messages import TokenDelta
from disagg.v1 import serving_pb2, serving_pb2_grpc


class ServingServicer(serving_pb2_grpc.ServingServicer):
    def __init__(
        self, path: RequestPath, directory: InstanceDirectory, model_name: str, replanning: ReplanView | None = None
    ):
        """`replanning`: the controller's re-planning decisions, where it re-plans (shown)."""
        self.path = path
        self.orchestrator = path.orchestrator
        self.directory = directory
        self.metrics = path.metrics
        self.model_name = model_name
        self.replanning = replanning

    # ---- Generate --------------------------------------------------------------------------------
    async def Generate(self, request, context):
        received_at = time.monotonic()  # the client's TTFT starts about here: what the router's predictions aim at
        await self._check_key(context)
        await self._refuse_on_error(context, self.path.admit)
        await self._refuse_undecodable(request, context)
        request_id = request.request_id or uuid.uuid4().hex
        await self._refuse_on_error(context, self.path.claim, request_id)
        try:
            # grpc.aio hands calls over one at a time: a flood may look like a steady load
            prompt_ids, params = await self.path.prepare(request, one_at_a_time=True)
        except BaseException as exc:
            self.path.release(request_id)
            if isinstance(exc, InvalidRequestError):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise
        # The response headers go out while the prompt computes, so that at the first token only
        # its message is left to send: one write and one wake-up of the client fewer on the TTFT
        # path.
        headers = asyncio.ensure_future(context.send_initial_metadata(()))
        headers.add_done_callback(_retrieve)
        demand = self.path.demand(request)
        deltas = self.path.stream(request_id, prompt_ids, params, demand, received_at, context.cancelled)
        try:
            async for delta, outcome in deltas:
                await headers  # done long before: a prompt takes milliseconds at least
                yield _response(request_id, delta, outcome)
        except RequestFailed as exc:
            await asyncio.wait([headers])  # the status follows the headers, never races them
            await context.abort(getattr(grpc.StatusCode, exc.code), exc.message)
        finally:
            await deltas.aclose()  # gRPC stopped reading: the request ends on the workers now

    # ---- Abort, ClusterStatus --------------------------------------------------------------------
    async def Abort(self, request, context):
        await self._check_key(context)
        await self._refuse_undecodable(request, context)
        return serving_pb2.AbortResponse(found=self.path.abort(request.request_id))

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
                    kv_paths=load.kv_paths,
                    kv_tiers=flat_kv_tiers(load.kv_tiers, len(inst.indexed_hashes)),
                )
            )
            self.metrics.set_instance_load(
                inst.instance_id, inst.role, load.num_running, load.num_waiting, load.kv_cache_usage
            )
        return serving_pb2.ClusterStatusResponse(
            pools=[serving_pb2.Pool(role=r, instances=i) for r, i in pools.items()],
            model=self.model_name,
            mode=self.orchestrator.config.mode,
            default_slo=serving_pb2.Slo(**slo.to_dict()),
            replan=self.replanning is not None,
            replan_decisions=[_replan_decision(e) for e in reversed(self.replanning.log)] if self.replanning else [],
        )

    async def _check_key(self, context) -> None:
        given = given_key(context.invocation_metadata())
        if not self.path.authorized(given):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong x-api-key")

    @staticmethod
    async def _refuse_on_error(context, check, *args) -> None:
        """Run an admission check of the request path; its refusal ends the call with its code."""
        try:
            check(*args)
        except DisaggError as exc:
            await context.abort(getattr(grpc.StatusCode, grpc_code_name(exc)), str(exc))

    async def _refuse_undecodable(self, request, context) -> None:
        if isinstance(request, Undecodable):
            self.metrics.observe_failure("INVALID_ARGUMENT")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request could not be decoded: {request.reason}")


def _response(request_id: str, delta: TokenDelta, outcome: Outcome | None) -> serving_pb2.GenerateResponse:
    msg = serving_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=delta.logprobs,
        finished=delta.finished,
    )
    if outcome is not None:
        msg.finish_reason = outcome.finish_reason
        msg.usage.CopyFrom(
            serving_pb2.Usage(
                prompt_tokens=outcome.prompt_tokens,
                completion_tokens=outcome.completion_tokens,
                cached_prompt_tokens=outcome.cached_prompt_tokens,
            )
        )
        msg.timings.CopyFrom(
            serving_pb2.Timings(
                queue_s=outcome.queue_s,
                prefill_s=outcome.prefill_s,
                transfer_s=outcome.transfer_s,
                decode_s=outcome.decode_s,
                ttft_s=outcome.ttft_s,
                e2e_s=outcome.e2e_s,
                prefill_instance=outcome.prefill_instance,
                decode_instance=outcome.decode_instance,
                predicted_ttft_s=outcome.predicted_ttft_s,
                predicted_tpot_s=outcome.predicted_tpot_s,
            )
        )
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
        step_kind=switch.kind if switch else "",
        **_check_fields(entry.check),
    )


def _check_fields(check) -> dict:
    """A switch's check as ReplanDecision's fields ({} where none)."""
    if check is None:
        return {}
    measured, stay = check.measured, check.stay
    return {
        "check_outcome": check.outcome,
        "predicted_attainment": check.predicted.attainment,
        "predicted_goodput": check.predicted.goodput,
        "measured_attainment": measured.attainment if measured else 0.0,
        "measured_goodput": measured.goodput if measured else 0.0,
        "stay_attainment": stay.attainment if stay else 0.0,
        "predicted_stay_attainment": check.predicted_stay.attainment,
    }
