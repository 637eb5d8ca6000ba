"""One request's path through the router, whichever API it came in by (gRPC `Generate`, the
OpenAI-compatible HTTP endpoints): admission, validation to prompt ids and SamplingParams, the
orchestrator's deltas, metrics, the finished request's record, and what a cancel or an Abort
leaves to clean up.

Neither frontend calls the other. Each translates its wire format to a `GenerateRequest` (the
public API's plain message) and back, and answers a refusal or a `RequestFailed` with the status
its gRPC code name maps to (disagg.errors: one table for both APIs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from disagg.engine.grammar import GrammarCompiler
from disagg.errors import DisaggError, InvalidRequestError, OverloadedError, UnavailableError, grpc_code_name
from disagg.metrics import ServingMetrics
from disagg.request import SamplingParams
from disagg.router.arrivals import Arrivals
from disagg.router.key_guard import key_matches
from disagg.router.orchestrator import Orchestrator
from disagg.router.records import RequestRecords
from disagg.router.stream_stats import Outcome, StreamStats
from disagg.router.validation import (
    PRIORITY_NAMES,
    ModelLimits,
    check_fits,
    check_model_bounds,
    check_priority,
    check_request_id,
    check_slo,
    check_text_size,
    prompt_token_ids,
    sampling_params,
)
from disagg.rpc.messages import TokenDelta
from disagg.slo import SLO, met, tpot_s
from disagg.v1 import serving_pb2

logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request that ended without its last delta; `code` is the gRPC status code name that
    both APIs answer it with, `message` what the client is told."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class RequestPath:
    def __init__(
        self,
        orchestrator: Orchestrator,
        tokenizer,
        limits: ModelLimits,
        metrics: ServingMetrics,
        records: RequestRecords | None,
        verdicts: Callable[[bool], None] | None = None,
    ):
        """`verdicts(met)`: told each request's SLO verdict beside the metrics (the re-planner's
        feed, shared_arrivals.VerdictFeed)."""
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics
        self.records = records
        self.verdicts = verdicts
        self.max_inflight = orchestrator.config.frontend_inflight_limit()
        self._active: dict[str, asyncio.Task] = {}  # request id -> the task serving it
        self._aborted: set[str] = set()  # ended by Abort: their streams end with finish_reason "abort"
        self.draining = False
        self.arrivals = Arrivals()  # a burst's refusals are answered before its admitted requests' work
        self._grammars: GrammarCompiler | None = None  # built at the first structured request

    # ---- before any work -------------------------------------------------------------------------
    def authorized(self, given_key: str) -> bool:
        """Whether the key a client sent (gRPC's `x-api-key`, HTTP's bearer token) is the config's
        `api_key` (any key, when none is set)."""
        return key_matches(self.orchestrator.config.api_key, given_key)

    def arrived(self) -> None:
        """A request came to a frontend's door (admitted or not, refused by gRPC's core too): the
        frontends call it first thing, before any await. It is what tells a burst of arrivals
        (disagg.router.arrivals)."""
        self.arrivals.arrived()

    def admit(self, num_requests: int = 1) -> None:
        """Room for `num_requests` more (an HTTP request's n choices count one each), or the
        refusal: UnavailableError while draining, OverloadedError over the in-flight bound."""
        if self.draining:
            raise UnavailableError("server is shutting down")
        if len(self._active) + num_requests > self.max_inflight:
            self.metrics.observe_failure("RESOURCE_EXHAUSTED")
            raise OverloadedError(f"{self.max_inflight} requests in flight; try again later")

    def claim(self, request_id: str) -> None:
        """The id is the current task's and counts against admission from here on. Call it with
        no await since `admit`, so that tokenizing (on a thread) lets no more in than the bound."""
        try:
            check_request_id(request_id)
            if request_id in self._active:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        except InvalidRequestError:
            self.metrics.observe_failure("INVALID_ARGUMENT")
            raise
        self._active[request_id] = asyncio.current_task()

    def release(self, request_id: str) -> None:
        """A claimed id whose request will not run (its input was refused)."""
        self._active.pop(request_id, None)

    async def prepare(
        self, request: serving_pb2.GenerateRequest, one_at_a_time: bool = False
    ) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the sampling params, or InvalidRequestError naming the field.
        In a burst of arrivals, only once it is over: the first of a request's work.
        `one_at_a_time`: its frontend is handed requests one at a time (gRPC's), so a flood may
        come spaced out (disagg.router.arrivals: the probe)."""
        await self.arrivals.after_burst(probe=one_at_a_time)
        try:
            check_slo(request.slo)
            check_priority(request.priority)
            params = sampling_params(request.sampling, self.tokenizer)
            check_model_bounds(params, self.limits)
            check_text_size(request, self.limits)
            # Tokenizing grows with the text, compiling with the grammar: off the event loop that
            # streams everyone's tokens.
            ids = await asyncio.to_thread(prompt_token_ids, request, self.tokenizer, self.limits.vocab_size)
            check_fits(len(ids), params, self.limits)
            if params.structured is not None:
                await asyncio.to_thread(self._check_grammar, params)
        except InvalidRequestError:
            self.metrics.observe_failure("INVALID_ARGUMENT")
            raise
        return ids, params

    def _check_grammar(self, params: SamplingParams) -> None:
        """A grammar the engines could not compile is refused here, before it costs them anything."""
        if self.tokenizer is None:
            raise InvalidRequestError("sampling.structured", "structured output needs a tokenizer; this model has none")
        if self._grammars is None:
            tokenizer = self.tokenizer
            self._grammars = GrammarCompiler(tokenizer.hf_tokenizer, self.limits.vocab_size, tokenizer.eos_token_ids)
        try:
            self._grammars.check(params.structured)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"sampling.{exc.field}", str(exc).split(": ", 1)[-1]) from None

    def demand(self, request: serving_pb2.GenerateRequest) -> tuple[SLO, str]:
        """The request's SLO (each target 0: the server's) and priority name."""
        default = self.orchestrator.default_slo
        return SLO.of(request.slo, default), PRIORITY_NAMES.get(request.priority, "standard")

    # ---- the run -----------------------------------------------------------------------------------
    async def stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        demand: tuple[SLO, str],
        received_at: float,
        client_gone: Callable[[], bool],
    ) -> AsyncIterator[tuple[TokenDelta, Outcome | None]]:
        """(delta, outcome) of a claimed request, the outcome with the last delta only. A cancel
        of the caller's task (its client went away) or closing this iterator frees the request's
        blocks on every instance; an Abort ends it with a last delta saying "abort"; any other
        end raises RequestFailed. `received_at`: when the frontend got it (time.monotonic())."""
        stats = StreamStats(time.perf_counter(), len(prompt_ids))
        deltas = self.orchestrator.generate(request_id, prompt_ids, params, *demand, received_at)
        try:
            async for delta in deltas:
                if request_id in self._aborted:
                    # Abort's cancel can be lost (it may land while the frontend writes, outside
                    # this generator): the next delta ends the stream instead.
                    raise asyncio.CancelledError
                outcome = self._observe(request_id, stats, delta)
                if outcome is not None:
                    self._judged(demand[1], meets_slo(outcome, demand[0]))
                yield delta, outcome
        except asyncio.CancelledError:
            await deltas.aclose()  # the attempt's cleanup (aborts on the workers) runs now
            self._active.pop(request_id, None)  # no longer counts against admission, whatever cleanup is left
            if request_id not in self._aborted:
                self.metrics.observe_failure("CANCELLED")
                raise
            self._aborted.discard(request_id)
            last = TokenDelta(request_id, [], finished=True, finish_reason="abort")
            yield last, self._observe(request_id, stats, last)
        except (DisaggError, asyncio.TimeoutError) as exc:
            code = "DEADLINE_EXCEEDED" if isinstance(exc, asyncio.TimeoutError) else grpc_code_name(exc)
            self._judged(demand[1], False)  # refused on its prediction, or failed: a miss
            raise self._failed(code, str(exc) or type(exc).__name__) from exc
        except (ValueError, ArithmeticError) as exc:
            # Bad input was refused by prepare() (or by a worker, as RemoteError): this is the
            # router's own bug, and the client must not be told it sent garbage.
            logger.exception("request %s failed inside the router", request_id)
            raise self._failed("INTERNAL", f"internal error: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # a worker died mid-request (RayActorError and friends)
            if client_gone():  # no: the client went away (before anything was sent, say)
                self.metrics.observe_failure("CANCELLED")
                return
            logger.exception("request %s failed", request_id)
            raise self._failed("UNAVAILABLE", f"worker failed: {type(exc).__name__}: {exc}") from exc
        finally:
            await deltas.aclose()  # a caller that stopped reading: the workers drop the request now
            self._active.pop(request_id, None)
            self._aborted.discard(request_id)  # an Abort that came as the stream ended must not outlive it

    def _judged(self, slo_class: str, met: bool) -> None:
        self.metrics.observe_slo(slo_class, met)
        if self.verdicts is not None:
            self.verdicts(met)

    def _observe(self, request_id: str, stats: StreamStats, delta: TokenDelta) -> Outcome | None:
        outcome = stats.observe(delta)
        if outcome is not None:
            self._record(request_id, outcome)
        return outcome

    def _record(self, request_id: str, outcome: Outcome) -> None:
        self.metrics.observe_finished(
            outcome.ttft_s,
            outcome.e2e_s,
            list(outcome.itl),
            outcome.queue_s,
            outcome.prefill_s,
            outcome.decode_s,
            outcome.prompt_tokens,
            outcome.completion_tokens,
            outcome.finish_reason,
        )
        if outcome.transfer_s:
            self.metrics.observe_transfer(outcome.transfer_s, outcome.transfer_bytes)
        if self.records is not None:
            self.records.add(outcome.record(request_id))

    def _failed(self, code: str, message: str) -> RequestFailed:
        self.metrics.observe_failure(code)
        return RequestFailed(code, message)

    # ---- ending requests from outside --------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """End a request in flight (its stream's last delta says "abort"); whether it was found."""
        task = self._active.get(request_id)
        if task is not None:
            self._aborted.add(request_id)
            task.cancel()
        return task is not None

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; give those in flight `timeout_s` to finish, then cancel them."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in list(self._active.values()):
            task.cancel()


def meets_slo(outcome: Outcome, slo: SLO) -> bool:
    """The one rule (disagg.slo.met) on a finished request; an aborted one is judged on what it got."""
    return met(slo, outcome.ttft_s * 1e3, tpot_s(outcome.e2e_s, outcome.ttft_s, outcome.completion_tokens) * 1e3)
