"""One request's journey through the pools (DESIGN.md, "One request, end to end").

Disaggregated: choose a prefill instance P and a decode instance D; D reserves blocks for the
prompt (the handshake) and starts listening to P; P computes the prompt, streams its KV layer
by layer into those blocks and returns the first token; D then decodes and its tokens reach the
client through the instance's stream. Colocated: one instance does both; so does a decode
instance the policy chose to prefill a short prompt itself (conditional disaggregation).

Whatever else ends the request (client cancel, deadline, error), both instances are told to
drop it, so no block stays allocated. A request that finished has nothing left on either side
(the decode side freed its blocks, the prefill side frees its own on the decode side's ack), so
its end costs no calls.

An instance that fails under a request (its link breaks, the KV never arrives) does not end it:
the request migrates (disagg.router.migration), up to `max_migrations` times, waiting up to
`recovery_timeout_s` for a healthy instance where none is left (a relaunch takes seconds).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from disagg.config import ServingConfig
from disagg.errors import (
    KVTransferError,
    OverloadedError,
    RemoteError,
    RequestFailedError,
    UnavailableError,
    WorkerLinkError,
)
from disagg.engine.block_manager import BlockManager, num_held, out_of_window_blocks
from disagg.placement.policies import Choice, PlacementPolicy, RequestShape
from disagg.request import SamplingParams, priority_value
from disagg.router.directory import Instance, InstanceDirectory
from disagg.router.decode_admission import DecodeAdmission
from disagg.router.decode_room import DecodeRoom
from disagg.router.migration import Progress, is_migratable
from disagg.router.output_lengths import OutputLengths
from disagg.placement.peer_fetch import saved_prefill_ms
from disagg.router.peer_fetch import PeerFetch
from disagg.router.prompt_queue import SentPrompt
from disagg.router.streams import DecodeStreams, Mailbox
from disagg.rpc.messages import TokenDelta
from disagg.slo import SLO

logger = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 5.0
RESERVE_RETRY_S = 0.02  # first back-off while no decode instance has room; doubles up to 0.5 s
KV_WAIT_MARGIN = 2.0  # the decode side waits this many times the predicted prefill queue for the first KV


@dataclass
class Placement:
    prefill: Instance | None
    decode: Instance | None  # None until the handshake found one
    finished: bool = False  # the decode side sent the last delta: nothing is left to abort
    # A decode instance asked to reserve, whose answer has not come: if the request ends now, it
    # may hold blocks that only an abort frees (else they wait out the KV deadline).
    reserving: Instance | None = None
    choice: Choice | None = None  # the policy's, with its predictions
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    num_tokens: int = 0
    queued: SentPrompt | None = None  # its prompt in the decode instance's queue, until its first token
    # What a live move (disagg.router.live_moves) needs: the id the workers know the attempt by,
    # its tokens so far (prompt and outputs), its params and priority, and where its deltas come from.
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    params: SamplingParams | None = None
    priority: int = 0  # the engine's (disagg.request.PRIORITY_VALUES)
    mailbox: Mailbox | None = None
    handover: "Handover | None" = None  # set by a move: the stream goes on at another instance
    moving_to: Instance | None = None  # a move's target, reserved: an end of the request aborts it there too
    waited_for_room: bool = False  # in the decode side's line: its TTFT says little of the prefill's

    def label(self, delta: TokenDelta) -> TokenDelta:
        prefilled_by = self.prefill or (self.decode if self.choice is not None and self.choice.local else None)
        delta.prefill_instance = prefilled_by.instance_id if prefilled_by else ""
        delta.decode_instance = self.decode.instance_id
        if self.choice is not None and math.isfinite(self.choice.ttft_ms):
            delta.predicted_ttft_s, delta.predicted_tpot_s = self.choice.ttft_ms / 1e3, self.choice.tpot_ms / 1e3
        return delta

    def observe(self, delta: TokenDelta) -> None:
        """The measured side of the predictions: when the first token came, how many followed."""
        if self.first_token_at is None and delta.token_ids:
            self.first_token_at = time.monotonic()
            self.dequeue()
        self.num_tokens += len(delta.token_ids)
        self.token_ids.extend(delta.token_ids)

    def dequeue(self) -> None:
        """The prompt is through (or the request ended): out of its instance's queue."""
        if self.queued is not None and self.decode is not None:
            self.decode.prompt_queue.remove(self.queued)
            self.queued = None


@dataclass
class Handover:
    """A move's second half: once the attempt has `at_tokens` outputs (all the source produced
    before it paused), its deltas come from `decode` through `mailbox`."""

    decode: Instance
    mailbox: Mailbox
    at_tokens: int


class ArrivalListener(Protocol):
    """Who hears each request as it arrives: the re-planner's traffic window
    (disagg.router.replanning.ReplanLoop), or a frontend's feed of it to the controller's
    (shared_arrivals.ArrivalFeed)."""

    def arrived(
        self, at: float, prompt_tokens: int, output_tokens: int, slo: SLO | None = None, priority: int = 0
    ) -> None:
        """`at`: time.monotonic(); the prompt's tokens, the output tokens the router expects (its
        `output_length` source: max_tokens or the ranker's); the request's own SLO (None: the
        server's) and its engine priority."""


class Orchestrator:
    def __init__(
        self,
        config: ServingConfig,
        directory: InstanceDirectory,
        policy: PlacementPolicy,
        streams: DecodeStreams,
        block_size: int,
        on_migration=lambda reason: None,
        sliding_window: int | None = None,
        arrivals: ArrivalListener | None = None,
        peer_fetch: PeerFetch | None = None,
        on_prefill_saved=lambda seconds: None,
    ):
        """`sliding_window`: the window every layer of the model has (ModelConfig.shared_window):
        a decode instance then reserves only the blocks of a prompt's last window. `arrivals`:
        who hears each request as it arrives (None: nobody). `peer_fetch`: fetches a prompt's
        cached prefix into its prefill instance from a peer that holds it (None: never).
        `on_prefill_saved`: told the prefill seconds each request's cached tokens saved (a metric)."""
        self.config = config
        self.sliding_window = sliding_window
        self.default_slo = config.slo
        self.on_migration = on_migration  # a request moved on after a failure (a metric counts them)
        self.directory = directory
        self.policy = policy
        self.streams = streams
        self.block_size = block_size
        self.output_lengths = OutputLengths.from_config(config)
        decode_engine = config.pool_engine_config(config.decode)
        self.decode_admission = DecodeAdmission(decode_engine.scheduling_order, decode_engine.priority_aging_s)
        self.decode_room = DecodeRoom(self.decode_admission)
        self._tasks: set[asyncio.Task] = set()
        self.live: dict[str, Placement] = {}  # worker-side id -> requests decoding now (live moves find them here)
        self.arrivals = arrivals
        self.peer_fetch = peer_fetch
        self.on_prefill_saved = on_prefill_saved

    @property
    def disaggregated(self) -> bool:
        return self.config.mode == "disaggregated"

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        slo: SLO | None = None,
        priority: str = "standard",
        received_at: float | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Deltas of the request, the first token first; the last one has finished=True. `slo`:
        the request's targets (None: the server's); `priority`: who is refused first, and who
        goes first in an instance's queue, batch and preemption;
        `received_at`: when the frontend got it (time.monotonic()), where its TTFT starts for the
        client, so the residuals learn what the predictions miss of that (now, if not given)."""
        progress = Progress(list(prompt_token_ids), params)
        progress.expected_output_tokens = self.output_lengths.predicted(prompt_token_ids, params.max_tokens)
        slo = slo or self.default_slo
        # In the engines a request keeps its own priority on every attempt (only admission treats
        # a later attempt as critical): a sheddable one does not pass others because it moved.
        engine_priority = priority_value(priority)
        if self.arrivals is not None:
            expected = self.output_lengths.expected(prompt_token_ids, params.max_tokens)
            own_slo = slo if slo != self.default_slo else None
            self.arrivals.arrived(time.monotonic(), len(prompt_token_ids), expected, own_slo, engine_priority)
        while True:
            # Once admitted, a request is not refused again: its later attempts are critical.
            demand = (slo, priority if not progress.migrations else "critical")
            started = received_at if received_at is not None and not progress.migrations else time.monotonic()
            try:
                attempt = self._attempt(
                    progress.attempt_id(request_id), progress.attempt_prompt(), progress.attempt_params(),
                    engine_priority, demand, started, progress.attempt_expected_output(),
                )  # fmt: skip
                async for delta in attempt:
                    yield progress.record(delta)
                return
            except Exception as exc:
                if not is_migratable(exc):
                    raise
                await self._migrate(request_id, progress, exc)

    async def _migrate(self, request_id: str, progress: Progress, exc: Exception) -> None:
        """Before the next attempt: within the limit, and once the pools it needs have an instance."""
        if progress.migrations >= self.config.max_migrations:
            raise UnavailableError(f"request failed on {progress.migrations + 1} instances; last: {exc}") from exc
        progress.migrations += 1
        logger.warning(
            "request %s migrates (%d/%d) after %d tokens: %s",
            request_id, progress.migrations, self.config.max_migrations, len(progress.streamed), exc,
        )  # fmt: skip
        self.on_migration(type(exc).__name__)
        roles = ("prefill", "decode") if self.disaggregated else ("colocated",)
        for role in roles:
            if not await self.directory.wait_healthy(role, self.config.recovery_timeout_s):
                raise UnavailableError(
                    f"no healthy {role} instance within {self.config.recovery_timeout_s:.0f}s after: {exc}"
                ) from exc

    async def _attempt(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        demand: tuple[SLO, str],
        started: float,
        expected_output: int | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """One try on one placement; `priority`: the engines'; `started`: when its TTFT is measured
        from; `expected_output`: the tokens it is predicted to write (None: no prediction)."""
        placement, mailbox = None, None
        hashes = tuple(BlockManager.prompt_hashes(prompt_token_ids, self.block_size))
        tpot_output = expected_output if self.output_lengths.for_tpot else None
        wait_ms = self.decode_room.wait_ms(priority, expected_output) if self.disaggregated else 0.0
        request = RequestShape(
            len(prompt_token_ids), params.max_tokens, *demand, self._blocks(prompt_token_ids), hashes, tpot_output,
            wait_ms,
        )  # fmt: skip
        try:
            if self.disaggregated:
                choice = self._place(await self._available("prefill"), await self._available("decode"), request)
            else:
                pool = await self._available("colocated")
                choice = self._place(pool, pool, request)
            if self.disaggregated and not choice.local:
                placement, mailbox, first = await self._start_disaggregated(
                    request_id, prompt_token_ids, params, priority, request, choice, started, expected_output
                )
                placement.observe(first)
                yield placement.label(first)
                if first.finished:
                    return
            else:
                placement, mailbox = await self._start_whole(
                    request_id, prompt_token_ids, params, priority, request, choice, started
                )
            self._track_live(placement, request_id, prompt_token_ids, params, priority, mailbox)
            async for delta in self._drain(placement):
                placement.finished = delta.finished
                placement.observe(delta)
                yield placement.label(delta)
            self._learn(placement)
        finally:
            if placement is not None:
                await self._cleanup(request_id, placement, len(prompt_token_ids))

    def _track_live(
        self, placement: Placement, request_id: str, prompt_token_ids, params, priority: int, mailbox: Mailbox
    ) -> None:
        placement.request_id, placement.params, placement.mailbox = request_id, params, mailbox
        placement.priority = priority
        placement.num_prompt_tokens = len(prompt_token_ids)
        placement.token_ids[:0] = prompt_token_ids  # before the outputs observed so far
        self.live[request_id] = placement

    def _blocks(self, prompt_token_ids: list[int]) -> int:
        return self.blocks_reserved(len(prompt_token_ids), len(prompt_token_ids))

    def blocks_reserved(self, num_tokens: int, num_kv_tokens: int) -> int:
        """The blocks a decode instance reserves for `num_tokens` positions when the KV of the
        first `num_kv_tokens` comes from elsewhere: not those their window left behind."""
        skipped = out_of_window_blocks(num_kv_tokens, self.block_size, self.sliding_window)
        return -(-num_tokens // self.block_size) - skipped

    def _place(self, prefills: list[Instance], decodes: list[Instance], request: RequestShape) -> Choice:
        choice = self.policy.choose_pair(prefills, decodes, request)
        if choice is None:
            missing = "prefill" if not prefills else "decode" if self.disaggregated else "colocated"
            raise UnavailableError(f"no healthy {missing} instance")
        if not choice.admitted:
            raise OverloadedError(choice.refusal(request.slo))
        return choice

    @staticmethod
    def _learn(placement: Placement) -> None:
        """A request that ran to its end: what its predictions missed, for the next ones."""
        choice, first = placement.choice, placement.first_token_at
        if choice is None or first is None or not math.isfinite(choice.ttft_ms):
            return
        prefill, decode = choice.prefill, choice.decode
        ttft_ms = (first - placement.started) * 1e3
        if not placement.waited_for_room:  # else the line's wait, predicted apart (decode_room)
            prefill.ttft_residual.observe(ttft_ms, choice.ttft_model_ms)
        if placement.num_tokens > 1:
            tpot_ms = (time.monotonic() - first) * 1e3 / (placement.num_tokens - 1)
            decode.tpot_residual.observe(tpot_ms, choice.tpot_model_ms)

    # ---- disaggregated ---------------------------------------------------------------------------
    async def _available(self, role: str) -> list[Instance]:
        """The role's instances in placement; while it has none but one is being relaunched,
        waits for it (up to recovery_timeout_s) instead of refusing the request."""
        if not self.directory.healthy(role) and self.directory.recovering(role):
            await self.directory.wait_healthy(role, self.config.recovery_timeout_s)
        return self.directory.healthy(role)

    async def _start_disaggregated(
        self,
        request_id,
        prompt_token_ids,
        params,
        priority: int,
        request: RequestShape,
        choice: Choice,
        started: float,
        expected_output: int | None,
    ) -> tuple[Placement, Mailbox, TokenDelta]:
        prefill = choice.prefill
        cached = choice.cached_tokens
        if self.peer_fetch is not None:  # the prefix it lacks and a peer holds, there first if faster
            cached = max(
                cached, await self.peer_fetch.fetch(request_id, prompt_token_ids, request.block_hashes, prefill)
            )
        self._saved(prefill, len(prompt_token_ids), cached)
        prefill.prefix_hashes.update(request.block_hashes)  # warm there from now on
        # The prefill starts at once; the handshake with the decode side runs meanwhile, and its
        # answer (where the KV goes) follows: the prefill does not wait a round trip to start.
        prefill.admit_prefill(len(prompt_token_ids))
        sent = prefill.prompt_queue.add(len(prompt_token_ids), cached)
        pending = choice.decode  # counted from the choice on, until its answer: concurrent choices see it
        pending.await_reservation()
        queued, sent_at = prefill.outstanding_prefill_tokens, time.monotonic()
        # The decode side waits for the first KV as long as the prefill's queue is predicted to take
        # (with margin), on top of the KV timeout; after that, each arrival restarts the wait.
        kv_wait_s = self.config.kv_timeout_s + KV_WAIT_MARGIN * prefill.prefill_rate.predict(queued)
        placement = Placement(prefill, None, choice=choice, started=started)
        prefill_call = None
        try:
            prefill_call = await prefill.prefill_service.prefill(request_id, prompt_token_ids, params, priority)
            decode, reservation = await self._reserve(
                request_id, prompt_token_ids, params, priority, prefill, kv_wait_s, placement, expected_output
            )
            pending.reservation_answered()  # answered: in the outstanding requests of `decode` from now on
            pending = None
            placement.decode = decode
            mailbox = self.streams.open(decode.instance_id, request_id)  # before the KV lands: no delta can be missed
            # The first token does not wait for the targets call (which returns only once the
            # prefill step ended and the KV is on its way): it goes to the client as soon as it exists.
            self._background(self._send_targets(prefill, request_id, reservation, mailbox))
            result = await asyncio.wait_for(prefill_call, self.config.request_timeout_s)
            prefill.prefill_rate.observe(queued, time.monotonic() - sent_at)
        except BaseException as exc:
            if prefill_call is not None:
                prefill_call.cancel()
            self._note_failure(exc)
            await self._cleanup(request_id, placement, len(prompt_token_ids))
            raise
        finally:
            prefill.release_prefill(len(prompt_token_ids))
            prefill.prompt_queue.remove(sent)
            if pending is not None:  # never answered
                pending.reservation_answered()
        first = TokenDelta.first(result)
        return placement, mailbox, first

    async def _send_targets(self, prefill: Instance, request_id: str, reservation, mailbox: Mailbox) -> None:
        """Tell the prefill where the KV goes; if it cannot, the request's stream ends in an error."""
        try:
            if await prefill.prefill_service.set_kv_targets(
                request_id, reservation, timeout_s=self.config.request_timeout_s
            ):
                return
            error = f"prefill instance {prefill.instance_id} dropped the request"
        except Exception as exc:  # the prefill worker died or failed
            self._note_failure(exc)
            error = f"prefill instance {prefill.instance_id}: {exc}"
        mailbox.put(TokenDelta.failed(request_id, error))

    def _note_failure(self, exc: BaseException) -> None:
        """A broken link, or a worker that says it failed, means a failed instance: keep it out
        of placement until it is back (its next registration)."""
        if isinstance(exc, (WorkerLinkError, RemoteError)) and exc.peer and is_migratable(exc):
            self.directory.mark_failed(exc.peer)

    def _background(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)  # a reference until it ends (the loop keeps only weak ones)
        task.add_done_callback(self._tasks.discard)

    async def _reserve(
        self,
        request_id,
        prompt_token_ids,
        params,
        priority: int,
        prefill: Instance,
        kv_wait_s: float,
        placement: Placement,
        expected_output: int | None,
    ):
        """The handshake: first on the policy's choice, then on whichever has room. While none
        has, the request waits in the decode side's admission line (disagg.router.decode_admission):
        once first in it, it retries with back-off; a newcomer queues behind those already waiting."""
        admission = self.decode_admission
        waiter = admission.join(priority, expected_output) if admission.waiting else None
        blocks_needed = self._blocks(prompt_token_ids)
        # The prefill instance holds the computed prompt for its targets for the KV timeout: a
        # longer wait for room would end in "dropped the request" and a prefill all over again.
        deadline = time.monotonic() + min(self.config.admission_timeout_s, self.config.kv_timeout_s)
        backoff = RESERVE_RETRY_S
        chosen = placement.choice.decode if placement.choice is not None else None
        try:
            while True:
                if waiter is not None and not await admission.wait_turn(waiter, deadline):
                    break
                decode = chosen or self.policy.choose_decode(await self._available("decode"), blocks_needed)
                chosen = None
                if decode is None:
                    raise UnavailableError("no healthy decode instance")
                urgency = priority if waiter is None else admission.priority_now(waiter)
                reservation = await self._reserve_on(
                    decode, request_id, prompt_token_ids, params, urgency, prefill, kv_wait_s, placement
                )
                if reservation is not None:
                    placement.waited_for_room = waiter is not None
                    return decode, reservation
                if time.monotonic() + backoff > deadline:
                    break
                waiter = waiter or admission.join(priority, expected_output)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 0.5)
        finally:
            if waiter is not None:
                admission.leave(waiter)
        waited = min(self.config.admission_timeout_s, self.config.kv_timeout_s)
        raise OverloadedError(f"no decode instance had room for {blocks_needed} KV blocks within {waited:.0f}s")

    async def _reserve_on(self, decode, request_id, prompt_token_ids, params, priority, prefill, kv_wait_s, placement):
        """One reservation on `decode`: its blocks and transfer ids, or None when it has no room."""
        placement.reserving = decode
        reservation = await decode.decode_service.reserve(
            request_id,
            prompt_token_ids,
            params,
            prefill.kv_layout,
            kv_wait_s,
            priority,
            timeout_s=self.config.admission_timeout_s,
        )
        placement.reserving = None
        if reservation is not None:
            decode.admit(len(prompt_token_ids), num_held(reservation.block_ids))
            if placement.choice is not None and placement.choice.decode is not decode:  # placed elsewhere after all
                placement.choice = None
        return reservation

    # ---- colocated, or prefilled on the decode instance (conditional disaggregation) ---------------
    async def _start_whole(
        self, request_id, prompt_token_ids, params, priority: int, request: RequestShape, choice: Choice, started: float
    ) -> tuple[Placement, Mailbox]:
        """One instance prefills and decodes: a colocated one, or a decode instance the policy
        chose to prefill a short prompt itself (no KV transfer)."""
        instance = choice.decode
        placement = Placement(None, instance, choice=choice, started=started)
        mailbox = self.streams.open(instance.instance_id, request_id)
        instance.admit(len(prompt_token_ids))
        placement.queued = instance.prompt_queue.add(len(prompt_token_ids), choice.cached_tokens)
        self._saved(instance, len(prompt_token_ids), choice.cached_tokens)
        instance.prefix_hashes.update(request.block_hashes)  # warm there from now on
        try:
            await instance.decode_service.submit(
                request_id, prompt_token_ids, params, priority, timeout_s=self.config.admission_timeout_s
            )
        except BaseException as exc:
            self._note_failure(exc)
            await self._cleanup(request_id, placement, len(prompt_token_ids))
            raise
        return placement, mailbox

    def _saved(self, instance: Instance, prompt_tokens: int, cached: int) -> None:
        """What `cached` tokens of the prompt saved its prefill instance, by that one's model."""
        if cached > 0:
            self.on_prefill_saved(saved_prefill_ms(instance.step_model, prompt_tokens, 0, cached) / 1e3)

    # ---- both --------------------------------------------------------------------------------------
    async def _drain(self, placement: Placement) -> AsyncIterator[TokenDelta]:
        deadline = time.monotonic() + self.config.request_timeout_s
        while True:
            self._take_handover(placement)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise asyncio.TimeoutError(f"request exceeded request_timeout_s={self.config.request_timeout_s}")
            delta = await placement.mailbox.get(remaining)
            if delta is None:
                continue  # woken by a move's handover
            if delta.error:
                raise (RequestFailedError if delta.request_fault else KVTransferError)(delta.error)
            yield delta
            if delta.finished:
                return

    def _take_handover(self, placement: Placement) -> None:
        """A moved request: once every token of the source has come, read the target."""
        handover = placement.handover
        if handover is None or placement.num_tokens < handover.at_tokens:
            return
        source = placement.decode
        self.streams.close(source.instance_id, placement.request_id)
        source.release(placement.num_prompt_tokens)
        placement.decode, placement.mailbox, placement.handover, placement.moving_to = (
            handover.decode, handover.mailbox, None, None
        )  # fmt: skip

    async def _cleanup(self, request_id: str, placement: Placement, num_prompt_tokens: int) -> None:
        """Forget the request here; unless it finished, tell both instances to drop it."""
        decode, aborts = placement.decode, []
        placement.dequeue()
        if self.live.get(placement.request_id) is placement:
            del self.live[placement.request_id]
        if placement.moving_to is not None and not placement.finished:  # a move under way: its target holds blocks
            target = placement.moving_to
            self.streams.close(target.instance_id, placement.request_id)
            aborts.append(target.decode_service.abort(placement.request_id, timeout_s=ABORT_TIMEOUT_S))
        if decode is not None:
            self.streams.close(decode.instance_id, request_id)
            decode.release(num_prompt_tokens)
            self.decode_room.freed()
        if placement.finished:
            return
        holder = decode or placement.reserving
        if self._may_hold(holder):  # a dead one has nothing to drop
            aborts.append(holder.decode_service.abort(request_id, timeout_s=ABORT_TIMEOUT_S))
        if self._may_hold(placement.prefill):
            aborts.append(placement.prefill.prefill_service.abort(request_id, timeout_s=ABORT_TIMEOUT_S))
        if aborts:  # sent now, awaited in the background: the request's end waits for no worker
            self._background(self._await_aborts(request_id, aborts))

    def _may_hold(self, instance: Instance | None) -> bool:
        return instance is not None and not self.directory.is_failed(instance)

    @staticmethod
    async def _await_aborts(request_id: str, aborts: list) -> None:
        try:
            await asyncio.wait_for(asyncio.gather(*aborts, return_exceptions=True), ABORT_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("abort of %s did not complete within %.0fs", request_id, ABORT_TIMEOUT_S)
