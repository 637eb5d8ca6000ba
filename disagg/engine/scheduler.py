"""Iteration-level continuous batching under one token budget per step.

Each step (Sarathi-Serve's stall-free batching): running decodes first (one token each), then
chunks of prompts already started, then new requests, until `max_num_batched_tokens` is spent.
When blocks run out, the lowest-priority, most recently admitted request is preempted (its
blocks freed, its tokens recomputed later), so the oldest requests always make progress and
nothing deadlocks. Priorities, the order within one, and the bound on any request's wait are
disagg.engine.queue_order's; with every request of one priority, all is first-come-first-served.

Fair prefill (issue 40): a prompt's chunk is first capped at `long_prefill_token_threshold`
tokens (vLLM's setting of that name; by default a quarter of the budget, 0: no cap), so that one
long prompt does not take every step's whole budget while short ones wait behind it for tens of
seconds. Once every prompt waiting for a chunk has had its capped share (in the order above:
started prompts by priority, then new ones in queue order), what is left of the budget goes to
the prompts cut short, the best priority first, then the fewest tokens left, first to those it
finishes: a short prompt behind a long one finishes its prefill in its first step. A step that
finishes a prompt gives the long ones only their cap, so that it stays short (its time is that
prompt's TTFT: a long prompt's extra tokens, attending to thousands before them, would multiply
it); a step that finishes none gives them the rest. Given the model's
`attention_context_tokens` (K), the caps and the rest are of work, not only tokens: a chunk of
a prompt counts each token 1 plus c / K for the c tokens it attends to (step_work.chunk_work),
the first share is the work of the cap's tokens at a prompt's start, and a step's prompt work
stays within the whole budget's there. A step deep in a long prompt then carries fewer tokens and
takes about as long as its first steps, so one that comes meanwhile waits no longer for it. The
router's TTFT forecast lays steps out the same way, on lengths alone
(disagg.placement.prefill_queue).

When `max_num_seqs` requests run, a request that outranks one of them (queue_order.displaces:
a better priority, or under ltr a much shorter predicted output) takes its slot: the running one
is suspended, its KV kept, and waits beside the waiting queue for a slot in the same order. So a
critical request, or under ltr a short answer, does not wait for a long generation to end. At
most `max_num_seqs` requests are suspended at once; when blocks run out, suspended requests are
preempted before running ones.

With `policy="prefill_first"` (vLLM v0's default, the other baseline) a step runs either whole
new prompts, unchunked and uncapped, or, when none waits, the decodes: decodes stall while
prompts run.

Roles: a PREFILL scheduler ends a request after its first token but keeps its blocks until
`release` (they are being exported); a DECODE scheduler admits requests whose blocks were
reserved up front and whose KV arrives from elsewhere (WAITING_FOR_KV).

Pure Python: `schedule()` returns a plain `SchedulerOutput`; a runner executes it and hands the
sampled tokens back to `update_from_output()`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg.config import DEFAULT_PRIORITY_AGING_S, Role, prefill_chunk_cap
from disagg.engine.block_manager import BlockManager
from disagg.engine.queue_order import (
    aged_priority,
    batch_order,
    check_order,
    displaces,
    held_priority,
    preemption_victim,
    waiting_order,
)
from disagg.errors import OverloadedError
from disagg.request import Request, RequestStatus, SamplingParams
from disagg.step_work import StepWork, chunk_work, tokens_within_work


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step (== num_computed_tokens when scheduled)
    num_new_tokens: int
    # Fixed when scheduled: the chunk reaches the end of the known tokens, so a token is sampled.
    samples: bool = field(init=False)
    # Its tokens are generated ones, none of the prompt's: a decode of what the last step sampled.
    generates: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_new_tokens == self.request.num_tokens
        self.generates = self.start >= self.request.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids[self.start : self.start + self.num_new_tokens]


# Statuses of a request outside both queues, blocks held: counted at every step, so listed.
PARKED = (RequestStatus.WAITING_FOR_KV, RequestStatus.HELD_FOR_EXPORT, RequestStatus.PAUSED, RequestStatus.SUSPENDED)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def work(self) -> StepWork:
        """What the step computes, as step reports, the latency model and the simulator describe it."""
        return StepWork.of((c.start, c.num_new_tokens) for c in self.chunks)


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None = None
    forced: list[int] = field(default_factory=list)  # what the request's grammar forces next (jump-forward)
    ends: bool = False  # the request's grammar is complete: nothing may follow


SCHEDULING_POLICIES = ("chunked", "prefill_first")


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        role: Role = Role.COLOCATED,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 128,
        max_waiting_requests: int = 4096,
        max_model_len: int = 8192,
        policy: str = "chunked",
        order: str = "fcfs",
        priority_aging_s: float = DEFAULT_PRIORITY_AGING_S,
        long_prefill_token_threshold: int | None = None,
        attention_context_tokens: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """`order`, `priority_aging_s`: see disagg.engine.queue_order; `long_prefill_token_threshold`:
        a prompt chunk's first share of a step (see above; None: a quarter of the budget, 0: no cap);
        `attention_context_tokens`: the model's ModelConfig.attention_context_tokens, with which
        fair prefill caps chunks by their work, not only their tokens (None: by tokens);
        `clock`: what waits are measured on (a simulation passes its own)."""
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        if long_prefill_token_threshold is not None and long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold: must be >= 0, got {long_prefill_token_threshold!r}")
        check_order(order, priority_aging_s)
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.attention_context_tokens = attention_context_tokens
        self.policy = policy
        self.order = order
        self.priority_aging_s = priority_aging_s
        self.clock = clock
        self.block_manager = block_manager
        self.role = role
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_waiting_requests = max_waiting_requests
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # The one map by request id: every request not yet fully freed. Where one stands outside
        # the two queues above (waiting for its KV, held for export, paused, suspended) is its
        # status; the requests of each such status are also kept in a list, so that counting
        # them costs nothing per step (the planner's simulator counts them at every event).
        self.requests: dict[str, Request] = {}
        self._parked: dict[RequestStatus, list[Request]] = {status: [] for status in PARKED}

    # ---- admission -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._admit(request)
        self.waiting.append(request)

    def reserve_for_remote_prefill(self, request: Request) -> bool:
        """DECODE role: allocate blocks for the whole prompt now; KV arrives later. With every
        slot taken, it takes the slot of a running request it outranks (suspending that one)."""
        self._rebalance_slots()
        victim = None
        if self._slots_full():
            victim = self._displaced_by(request, self.clock())
            if victim is None:
                return False
        # Under a sliding window the blocks the window leaves behind at the prompt's end are not
        # reserved: the prefill does not send them (placeholders, see the block manager).
        skip = self.block_manager.num_out_of_window(request.num_prompt_tokens)
        if not self.block_manager.allocate_slots(request, request.num_prompt_tokens, skip_blocks=skip):
            return False
        if victim is not None:
            self._suspend(victim)
        self._admit(request)
        self._take_slot(request)
        self._set_status(request, RequestStatus.WAITING_FOR_KV)
        return True

    def finish_kv_import(self, request_id: str, first_token_id: int) -> Request:
        """DECODE role: the prompt's KV is in place; decode from the first token on."""
        request = self._in_status(request_id, RequestStatus.WAITING_FOR_KV)
        request.num_computed_tokens = request.num_prompt_tokens
        request.append_output_token(first_token_id)
        self._set_status(request, RequestStatus.RUNNING)
        request.timings.kv_ready = request.timings.first_scheduled = time.perf_counter()
        # Released before hashed: a block the window left behind may hold KV that never came
        # (a moving request's source had released it; see KVSender).
        self.block_manager.release_out_of_window(request)
        self.block_manager.cache_full_blocks(request)
        if not self._check_stop(request):
            self.running.append(request)
        return request

    # ---- live migration (disagg.decode_worker.migration) -----------------------------------
    def pause(self, request_id: str) -> Request:
        """Take a decoding request out of the batch with its blocks kept (its KV is moving)."""
        request = self.requests.get(request_id)
        if request is None or request not in self.running or request.num_tokens - request.num_computed_tokens != 1:
            raise ValueError(f"pause: {request_id!r} is not decoding here")
        self.running.remove(request)
        self._set_status(request, RequestStatus.PAUSED)
        return request

    def resume(self, request_id: str) -> Request:
        """The move failed: decode it here again, from where it paused."""
        request = self._in_status(request_id, RequestStatus.PAUSED)
        self._set_status(request, RequestStatus.RUNNING)
        self.running.append(request)
        return request

    def reserve_for_migration(self, request: Request, capacity_tokens: int) -> bool:
        """Blocks for `capacity_tokens` positions (the request's known tokens and those its source
        may add before it pauses); its KV arrives as a remote prefill's does."""
        if len(self.running) + len(self.waiting_for_kv) >= self.max_num_seqs:
            return False
        # It arrives with the KV of at least the tokens known now, so the window has left behind
        # at least the blocks before theirs (its source does not send them).
        skip = self.block_manager.num_out_of_window(request.num_prompt_tokens)
        if not self.block_manager.allocate_slots(
            request, max(capacity_tokens, request.num_prompt_tokens), skip_blocks=skip
        ):
            return False
        self._admit(request)
        self._set_status(request, RequestStatus.WAITING_FOR_KV)
        return True

    def finish_migration_import(
        self, request_id: str, token_ids: list[int], last_token: int, params: SamplingParams
    ) -> Request:
        """The KV of `token_ids` is in: they become the prompt, `last_token` (sampled at the
        source, not yet computed) the first output, and decoding goes on under `params`."""
        request = self._in_status(request_id, RequestStatus.WAITING_FOR_KV)
        known = request.num_prompt_tokens
        if list(token_ids[:known]) != request.prompt_token_ids:
            raise ValueError(f"migration of {request_id!r}: the tokens do not continue the reserved ones")
        if self.block_manager.num_blocks_for(len(token_ids) + 1) > len(request.block_ids):
            raise ValueError(f"migration of {request_id!r}: {len(token_ids)} tokens outgrew the blocks reserved")
        request.prompt_token_ids = list(token_ids)
        request.token_ids = list(token_ids)
        request.sampling_params = params
        return self.finish_kv_import(request_id, last_token)

    # ---- batch slots: who is in the batch when more want in than max_num_seqs ---------------
    def _slots_full(self) -> bool:
        return len(self.running) + len(self.waiting_for_kv) >= self.max_num_seqs

    def _displaced_by(self, challenger: Request, now: float) -> Request | None:
        """The running request whose slot `challenger` may take now, if any: the one preemption
        would pick among those decoding, when the challenger outranks it and room to suspend it is left."""
        if len(self.suspended) >= self.max_num_seqs:
            return None
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        victim = preemption_victim(decoding, self.order)
        by_length = challenger.status is not RequestStatus.SUSPENDED
        if victim is None or not displaces(challenger, victim, now, self.order, self.priority_aging_s, by_length):
            return None
        return victim

    def _suspend(self, request: Request) -> None:
        self.running.remove(request)
        self._set_status(request, RequestStatus.SUSPENDED)
        # It ran until now, so it waits from now, but keeps the rise it had earned: its wait is
        # counted from as far back as its held priority says (queue_order.aged_priority).
        earned = request.priority - held_priority(request)
        request.queued_at = self.clock() - earned * self.priority_aging_s
        request.held_priority = None

    def _take_slot(self, request: Request) -> None:
        request.held_priority = aged_priority(request, self.clock(), self.priority_aging_s)

    def _rebalance_slots(self) -> None:
        """Suspended and waiting requests, in queue order, take the free slots, then the slots
        of running requests they displace; a suspended one resumes at once, a waiting one is
        admitted by this step's _schedule_waiting (when its blocks fit)."""
        if not self.suspended and not (self.waiting and self._slots_full()):
            return
        now = self.clock()
        contenders = waiting_order([*self.suspended, *self.waiting], now, self.order, self.priority_aging_s)
        free = self.max_num_seqs - len(self.running) - len(self.waiting_for_kv)
        for request in contenders:
            if free <= 0:
                victim = self._displaced_by(request, now)
                if victim is None:
                    break
                if request.status is not RequestStatus.SUSPENDED and not self._fits_first_chunk(request):
                    break
                self._suspend(victim)
                free += 1
            if request.status is RequestStatus.SUSPENDED:
                self._resume_suspended(request)
            free -= 1

    def _fits_first_chunk(self, request: Request) -> bool:
        cached = self.block_manager.find_cached_prefix(request)
        num_new = min(request.num_tokens - len(cached) * self.block_manager.block_size, self.chunk_cap)
        return self.block_manager.can_allocate(request, num_new, cached)

    def _resume_suspended(self, request: Request) -> None:
        self._set_status(request, RequestStatus.RUNNING)
        self._take_slot(request)
        self.running.append(request)

    def _admit(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        if len(self.waiting) >= self.max_waiting_requests:
            raise OverloadedError(f"waiting queue is full ({self.max_waiting_requests} requests)")
        self.requests[request.request_id] = request
        if request.queued_at is None:
            request.queued_at = self.clock()

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._rebalance_slots()
        if self.policy == "prefill_first" and self.waiting:
            out = SchedulerOutput()
            self._schedule_whole_prompts(out)
            if out.chunks:
                return out
        return self._schedule_chunked()

    def _schedule_whole_prompts(self, out: SchedulerOutput) -> None:
        """Prefill-first: admit waiting prompts whole (the first one even beyond the budget)."""
        budget = self.max_num_batched_tokens
        awaiting_kv = len(self.waiting_for_kv)  # unchanged while waiting requests are admitted
        for request in self._waiting_in_order():
            if len(self.running) + awaiting_kv >= self.max_num_seqs:
                break
            num_new = request.num_tokens - request.num_computed_tokens
            if out.chunks and num_new > budget:
                break
            if not self._admit_waiting(request, num_new, out, cached=[]):
                break
            budget -= num_new

    @property
    def chunk_cap(self) -> int:
        """A prompt chunk's first share of a step: the budget itself where fair prefill is off
        (and under prefill_first, the baseline kept as it was). Read each step, since the
        profiler sets the budget step by step."""
        if self.policy == "prefill_first":
            return self.max_num_batched_tokens
        return prefill_chunk_cap(self.max_num_batched_tokens, self.long_prefill_token_threshold)

    @property
    def _work_context(self) -> float | None:
        """attention_context_tokens where fair prefill is on: chunks are then capped by work."""
        return self.attention_context_tokens if self.chunk_cap < self.max_num_batched_tokens else None

    def _first_share(self, start: int, cap: int) -> int:
        """A prompt chunk's first share after `start` known tokens: the work of `cap` tokens at
        a prompt's start (as many tokens there; fewer deeper in, where each attends to more)."""
        context = self._work_context
        return max(1, tokens_within_work(start, chunk_work(0, cap, context), context))

    def _schedule_chunked(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        cap = self.chunk_cap
        scheduled: set[str] = set()
        running = batch_order(self.running)
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            left = request.num_tokens - request.num_computed_tokens
            num_new = (
                min(left, budget)
                if left == 1
                else min(left, budget, self._first_share(request.num_computed_tokens, cap))
            )
            if self._allocate_or_preempt(request, num_new, scheduled, out):
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
                scheduled.add(request.request_id)
                budget -= num_new
        if not out.preempted:  # after a preemption there is no room for newcomers
            budget = self._schedule_waiting(budget, out, cap)
        self._share_leftover(budget, out)
        return out

    def _schedule_waiting(self, budget: int, out: SchedulerOutput, cap: int) -> int:
        awaiting_kv = len(self.waiting_for_kv)  # unchanged while waiting requests are admitted
        for request in self._waiting_in_order():
            if budget <= 0 or len(self.running) + awaiting_kv >= self.max_num_seqs:
                break
            cached = self.block_manager.find_cached_prefix(request)
            known = len(cached) * self.block_manager.block_size
            num_new = min(request.num_tokens - known, budget, self._first_share(known, cap))
            if not self._admit_waiting(request, num_new, out, cached):
                break
            budget -= num_new
        return budget

    def _share_leftover(self, budget: int, out: SchedulerOutput) -> None:
        """Fair prefill's second round: the budget the caps left goes to the prompt chunks they
        cut short, the best priority first, then the fewest tokens left, first to those it
        finishes. A step that finishes a prompt gives the others no more than their cap: its
        time is that prompt's TTFT, which a long prompt's extra tokens (attending to thousands
        before them) would multiply. Otherwise the long ones take the rest, as long as the step's
        work stays within a whole budget's at a prompt's start: a step deep in a long prompt
        carries fewer tokens, so that one that comes meanwhile waits no longer for it. No
        preemption for it: a chunk whose blocks do not fit keeps its capped share, which already
        makes progress."""
        cut = [i for i, chunk in enumerate(out.chunks) if not chunk.samples]
        cut.sort(key=lambda i: (held_priority(out.chunks[i].request), self._tokens_left(out.chunks[i])))
        finishable = self._finishable(cut, budget, out, self._work_left(out))
        budget = self._extend(finishable, budget, out)
        if not any(c.samples and not c.generates for c in out.chunks):  # no prompt ends in this step
            self._extend([i for i in cut if not out.chunks[i].samples], budget, out, self._work_left(out))

    def _work_left(self, out: SchedulerOutput) -> float | None:
        """What the step may still compute within a whole budget's work at a prompt's start
        (None: work is not counted)."""
        context = self._work_context
        if context is None:
            return None
        spent = sum(
            1 if c.generates else chunk_work(c.start, c.num_new_tokens, context) for c in out.chunks
        )  # a decode counts as the budget counts it: one token
        return chunk_work(0, self.max_num_batched_tokens, context) - spent

    def _finishable(self, cut: list[int], budget: int, out: SchedulerOutput, work_left: float | None) -> list[int]:
        """Those of `cut` (in its order) that `budget` (and `work_left`, where work is counted)
        finishes, none of a worse priority than one it cannot finish (that one keeps its turn
        before them)."""
        chosen, unfinished_priority = [], None
        for i in cut:
            chunk = out.chunks[i]
            priority, left = held_priority(chunk.request), self._tokens_left(chunk)
            if unfinished_priority is not None and priority > unfinished_priority:
                break
            work = self._extra_work(chunk, left)
            if left <= budget and (work_left is None or work <= work_left):
                chosen.append(i)
                budget -= left
                work_left = None if work_left is None else work_left - work
            elif unfinished_priority is None:
                unfinished_priority = priority
        return chosen

    def _extra_work(self, chunk: ScheduledChunk, extra: int) -> float:
        """What `extra` more tokens add to the chunk's work."""
        context, n = self._work_context, chunk.num_new_tokens
        return chunk_work(chunk.start, n + extra, context) - chunk_work(chunk.start, n, context)

    def _extend(self, indices: list[int], budget: int, out: SchedulerOutput, work_left: float | None = None) -> int:
        """Give the chunks at `indices`, in turn, as much of `budget` as their prompts still need
        (and of `work_left`, the step's work, where it is counted)."""
        context = self._work_context
        for i in indices:
            chunk = out.chunks[i]
            extra = min(self._tokens_left(chunk), budget)
            if work_left is not None:
                own = chunk_work(chunk.start, chunk.num_new_tokens, context)
                extra = min(extra, tokens_within_work(chunk.start, own + work_left, context) - chunk.num_new_tokens)
            if extra > 0 and self.block_manager.allocate_slots(chunk.request, chunk.num_new_tokens + extra):
                budget -= extra
                if work_left is not None:
                    work_left -= self._extra_work(chunk, extra)
                out.chunks[i] = ScheduledChunk(chunk.request, chunk.start, chunk.num_new_tokens + extra)
        return budget

    @staticmethod
    def _tokens_left(chunk: ScheduledChunk) -> int:
        """Of the request's known tokens, those still to compute after `chunk`."""
        return chunk.request.num_tokens - chunk.start - chunk.num_new_tokens

    def _waiting_in_order(self) -> list[Request]:
        """The waiting requests, the next to admit first. Admission stops at the first that does
        not fit: one behind it must not take the blocks it waits for."""
        return waiting_order(self.waiting, self.clock(), self.order, self.priority_aging_s)

    def _admit_waiting(self, request: Request, num_new: int, out: SchedulerOutput, cached: list[int]) -> bool:
        """Move a waiting request to running with a first chunk of num_new tokens."""
        if not self.block_manager.allocate_slots(request, num_new, cached):
            return False
        num_cached = len(cached) * self.block_manager.block_size
        self.waiting.remove(request)
        request.num_computed_tokens = num_cached
        if request.num_output_tokens == 0:
            request.num_cached_tokens = num_cached
        self._set_status(request, RequestStatus.RUNNING)
        if request.timings.first_scheduled is None:
            request.timings.first_scheduled = time.perf_counter()
        self._take_slot(request)
        self.running.append(request)
        out.chunks.append(ScheduledChunk(request, num_cached, num_new))
        return True

    def _allocate_or_preempt(self, request: Request, num_new: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        while not self.block_manager.allocate_slots(request, num_new):
            # the suspended first: they hold blocks and compute nothing
            candidates = self.suspended or [
                r for r in self.running if r is not request and r.request_id not in scheduled
            ]
            victim = preemption_victim(candidates, self.order)
            self._preempt(victim or request, out)
            if victim is None:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        if request.status is not RequestStatus.SUSPENDED:
            self.running.remove(request)
        request.held_priority = None
        self.block_manager.free(request)
        self._set_status(request, RequestStatus.PREEMPTED)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    # ---- results -------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, SampledToken]) -> list[Request]:
        """Apply one executed step; returns the requests that got a new token or finished."""
        updated: list[Request] = []
        now = time.perf_counter()
        for chunk in out.chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.start + chunk.num_new_tokens
            self.block_manager.cache_full_blocks(request)
            self.block_manager.release_out_of_window(request)
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_output_token(token.token_id, token.logprobs)
            if request.timings.first_token is None:
                request.timings.first_token = now
            if not self._append_forced(request, token) and self.role is Role.PREFILL:
                self._hold_for_export(request)
            updated.append(request)
        return updated

    def _append_forced(self, request: Request, token: SampledToken) -> bool:
        """After the sampled token: the tokens its grammar forces (their KV is computed next
        step, as a short chunk), each checked for a stop; returns whether the request finished."""
        finished = self._check_stop(request)
        for forced in token.forced:
            if finished:
                break
            request.append_output_token(forced)
            finished = self._check_stop(request)
        if token.ends and not finished:
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            finished = True
        return finished

    def _check_stop(self, request: Request) -> bool:
        """Finish the request if its last token ends it; returns whether it finished."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if (not params.ignore_eos and last in request.eos_token_ids) or last in params.stop_token_ids:
            request.stop_reason = last
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
        return request.is_finished

    def _hold_for_export(self, request: Request) -> None:
        """PREFILL role: the first token is out; keep the blocks until the KV is exported."""
        self.running.remove(request)
        self._set_status(request, RequestStatus.HELD_FOR_EXPORT)
        request.timings.finished = time.perf_counter()

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (stop, length or abort) wherever it is, freeing its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._set_status(request, status)
        request.timings.finished = request.timings.finished or time.perf_counter()
        self.block_manager.free(request)
        return request

    def release(self, request_id: str) -> None:
        """PREFILL role: the KV has been exported (or the transfer gave up); free the blocks."""
        if self.holds(request_id, RequestStatus.HELD_FOR_EXPORT):
            self.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    # ---- many decode steps at once (the planner's simulator) -------------------------------
    def plain_decode_steps(self) -> int:
        """How many next steps are certain to be decodes of exactly the running batch: nothing
        waits, every running request is decoding and fits the budget, blocks suffice without a
        preemption, and no request stops before the last of them. 0 when the next step is not."""
        if self.role is Role.PREFILL or self.waiting or self.suspended or not self.running:
            return 0
        if len(self.running) > self.max_num_batched_tokens:
            return 0
        steps = self.max_model_len
        for request in self.running:
            if request.num_tokens - request.num_computed_tokens != 1:
                return 0
            steps = min(steps, request.sampling_params.max_tokens - request.num_output_tokens)
            steps = min(steps, self.max_model_len - request.num_tokens)
        free = self.block_manager.num_free_blocks
        if self._blocks_for_steps(1) > free:
            return 0  # the next step preempts
        low, high = 1, max(steps, 1)  # the most steps whose blocks are free (the need grows with steps)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self._blocks_for_steps(mid) <= free else (low, mid - 1)
        return low

    def advance_decodes(self, num_steps: int, token_id: int) -> list[Request]:
        """`num_steps` rounds of schedule() + update_from_output() sampling `token_id` for every
        request, at once; valid while `plain_decode_steps()` allows as many (stops are only
        checked after the last step). Returns the requests updated, as update_from_output."""
        if not 0 < num_steps <= self.plain_decode_steps():
            raise ValueError(f"advance_decodes: {num_steps} steps are not all plain decodes")
        now = time.perf_counter()
        updated = list(self.running)
        for request in updated:
            self.block_manager.allocate_slots(request, num_steps)
            request.num_computed_tokens += num_steps
            for _ in range(num_steps):
                request.append_output_token(token_id)
            self.block_manager.cache_full_blocks(request)
            self.block_manager.release_out_of_window(request)
            request.timings.first_token = request.timings.first_token or now
            self._check_stop(request)
        return updated

    def _blocks_for_steps(self, steps: int) -> int:
        bm = self.block_manager
        return sum(max(0, bm.num_blocks_for(r.num_computed_tokens + steps) - len(r.block_ids)) for r in self.running)

    # ---- queries -------------------------------------------------------------------------
    def _set_status(self, request: Request, status: RequestStatus) -> None:
        """Every change into or out of a parked status goes through here (its list follows)."""
        if request.status in self._parked:
            self._parked[request.status].remove(request)
        request.status = status
        if status in self._parked:
            self._parked[status].append(request)

    def _with_status(self, status: RequestStatus) -> list[Request]:
        """The requests of a parked status, in the order they took it (read-only to callers)."""
        return self._parked[status]

    def _in_status(self, request_id: str, status: RequestStatus) -> Request:
        request = self.requests.get(request_id)
        if request is None or request.status is not status:
            raise KeyError(f"{request_id!r} is not {status.name.lower()} here")
        return request

    @property
    def waiting_for_kv(self) -> list[Request]:
        """DECODE role: blocks reserved, KV not yet in."""
        return self._with_status(RequestStatus.WAITING_FOR_KV)

    @property
    def held_for_export(self) -> list[Request]:
        """PREFILL role: first token out, blocks kept until the KV is exported."""
        return self._with_status(RequestStatus.HELD_FOR_EXPORT)

    @property
    def paused(self) -> list[Request]:
        """Out of the batch while their KV moves elsewhere (live migration)."""
        return self._with_status(RequestStatus.PAUSED)

    @property
    def suspended(self) -> list[Request]:
        """Out of the batch, KV kept: displaced from their slot by a more urgent request."""
        return self._with_status(RequestStatus.SUSPENDED)

    def holds(self, request_id: str, status: RequestStatus) -> bool:
        request = self.requests.get(request_id)
        return request is not None and request.status is status

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv or self.suspended)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
