"""A discrete-event simulation of the serving system, running the real system's own policies.

Each simulated instance holds the engine's `Scheduler` and `BlockManager` (token budget, chunked
prefill or prefill-first, KV block capacity, preemption, fcfs or ltr order with priority aging
measured on the simulated clock: the same classes, not copies), and the router's placement
policy (`disagg.placement.policies`) places every request, as in the server. Only the model's
forward pass is replaced, by the profile's `StepModel`: a step lasts what the latency model says
for what the scheduler put in it.

What is modelled, as the real system does it:
- an instance takes new work only between steps (the engine loop applies commands between
  steps): requests, KV arrivals, reservations and releases wait for the step under way;
- disaggregated: the prefill starts at once; the decode side reserves blocks for the prompt in
  parallel (retried with the router's back-off while no instance has room), or with
  `decode_admission="queue"` (DistServe's) takes the request after its prefill, first come first
  served; the first token reaches the client at the end of its prefill step; the KV streams layer
  by layer during the prefill, or all at once if the reservation came later, over the prefill
  instance's link one request after another (a transfer queues behind those before it); the
  decode instance takes the request at its next step boundary; the prefill's blocks are freed
  when the transfer ends;
- colocated: one instance does both; so does a decode instance the policy chose to prefill a
  short prompt itself (conditional disaggregation);
- the frontend refuses a request that arrives while `max_inflight` are in flight (the server's
  `inflight_limit`), as it answers RESOURCE_EXHAUSTED;
- the policy chooses both instances at arrival (`choose_pair`) and may refuse the request (the
  goodput policy's SLO admission: the record fails "refused: ...").

Long runs of plain decode steps (the batch does not change) are advanced in one event with the
closed-form sum of their times (`Scheduler.advance_decodes`); an input arriving meanwhile cuts
the run at the step boundary after it. So events scale with requests, not tokens.

Not modelled: prefix caching (replayed prompts carry no token ids), the client's and router's
own processing (a constant `router_overhead_ms`), stop strings (requests run to their length).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg.config import DEFAULT_PRIORITY_AGING_S, Role, ServingConfig
from disagg.engine.block_manager import BlockManager, max_blocks_held, out_of_window_blocks
from disagg.engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from disagg.errors import InvalidRequestError, OverloadedError
from disagg.placement.latency_model import HostSharing, StepModel, TransferModel, sharing_kind
from disagg.placement.policies import LeastOutstandingWork, PlacementPolicy, RequestShape
from disagg.placement.prefill_queue import Decodes, QueuedPrompt
from disagg.planner.workload import SimRequest
from disagg.request import Request, RequestStatus, SamplingParams, check_fits
from disagg.slo import SLO, met, tpot_s

RESERVE_RETRY_S = 0.02  # the router's back-off while no decode instance has room (doubling to 0.5 s)
MAX_RESERVE_RETRY_S = 0.5
# How a request gets room on its decode instance: "retry", our router's (reserved while the
# prompt is computed; without room, retried with back-off: whoever retries first when room frees
# gets it); "queue", DistServe's bridge queue (after the prefill, first come first served at the
# decode instance, the KV waiting in the prefill's blocks meanwhile).
DECODE_ADMISSIONS = ("retry", "queue")
ABORTED = RequestStatus.FINISHED_ABORTED
TOKEN = 0  # the token every simulated step samples (stops come from max_tokens alone)
SEED_PREFIX = "live-"  # the ids of requests a live state starts with (load only, judged by no record)


@dataclass
class SimRecord:
    """One request's simulated life; times in seconds since the first arrival."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    first_token_s: float | None = None
    finish_s: float | None = None
    failed: str = ""
    error_code: str = ""  # the gRPC status the server would have answered (disagg.errors)
    prefill_instance: str = ""
    decode_instance: str = ""
    num_preemptions: int = 0
    slo: SLO | None = None  # the request's own targets (None: the run's)

    @property
    def success(self) -> bool:
        return self.finish_s is not None and not self.failed

    @property
    def ttft_s(self) -> float:
        return (self.first_token_s - self.arrival_s) if self.first_token_s is not None else math.inf

    @property
    def tpot_s(self) -> float:
        return tpot_s(self.e2el_s, self.ttft_s, self.output_len) if self.success else math.inf

    @property
    def e2el_s(self) -> float:
        return (self.finish_s - self.arrival_s) if self.success else math.inf


@dataclass(frozen=True)
class SimPool:
    """One pool as the simulator needs it: its instances' shape, latency and engine settings."""

    role: str  # "prefill" | "decode" | "colocated"
    num_instances: int
    step_model: StepModel
    num_kv_blocks: int
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    max_model_len: int = 8192
    scheduling_policy: str = "chunked"
    # The order its queue is served in and the starvation bound (disagg.engine.queue_order):
    # under "ltr", by each request's `SimRequest.predicted_output_len`.
    scheduling_order: str = "fcfs"
    priority_aging_s: float = DEFAULT_PRIORITY_AGING_S
    # Fair prefill's cap on a prompt chunk's first share of a step, as the engine's setting (None:
    # a quarter of the budget, 0: off): the simulated scheduler chunks as the real one does.
    long_prefill_token_threshold: int | None = None
    long_prefill_by_work: bool = True  # its caps count work (the step model's ratio), as the engine's
    max_waiting_requests: int = 1 << 30
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    name: str = ""
    # The window every attention layer of the model has (ModelConfig.shared_window): a request's
    # blocks that leave it are released, as the engine's block manager does (None: none).
    sliding_window: int | None = None

    @property
    def ranks(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def blocks_held(self, num_tokens: int) -> int:
        """The most blocks a request of `num_tokens` holds at once here (under a window, fewer)."""
        chunk = num_tokens if self.scheduling_policy == "prefill_first" else self.max_num_batched_tokens
        return max_blocks_held(num_tokens, self.block_size, self.sliding_window, chunk)

    def prompt_blocks_held(self, prompt_len: int) -> int:
        """The blocks a computed prompt holds: all of them, or under a window its last window's
        (what a decode instance reserves, and receives)."""
        return -(-prompt_len // self.block_size) - out_of_window_blocks(
            prompt_len, self.block_size, self.sliding_window
        )


def pools_from_config(
    config: ServingConfig,
    step_model_for: Callable[[str, int, int], StepModel],
    kv_bytes_per_token: int,
    max_model_len: int = 8192,
    sliding_window: int | None = None,
) -> list[SimPool]:
    """The pools a serving config runs; `step_model_for(role, tp, pp)` gives each its latency;
    `sliding_window`: the model's (ModelConfig.shared_window)."""
    pools = []
    for role, pool in config.pools():
        engine = config.pool_engine_config(pool)
        tp, pp = pool.tensor_parallel_size, pool.pipeline_parallel_size
        pools.append(
            SimPool(
                role=role,
                num_instances=pool.num_instances,
                step_model=step_model_for(role, tp, pp),
                num_kv_blocks=_num_kv_blocks(engine, tp * pp, kv_bytes_per_token),
                block_size=engine.block_size,
                max_num_batched_tokens=engine.max_num_batched_tokens,
                max_num_seqs=engine.max_num_seqs,
                max_model_len=engine.max_model_len or max_model_len,
                scheduling_policy=engine.scheduling_policy,
                scheduling_order=engine.scheduling_order,
                priority_aging_s=engine.priority_aging_s,
                long_prefill_token_threshold=engine.long_prefill_token_threshold,
                long_prefill_by_work=engine.long_prefill_by_work,
                max_waiting_requests=engine.max_waiting_requests,
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
                name=role,
                sliding_window=sliding_window,
            )
        )
    return pools


def _num_kv_blocks(engine, ranks: int, kv_bytes_per_token: int) -> int:
    """As the engine sizes its cache: `num_kv_blocks`, else each rank's memory over its share of a block."""
    if engine.num_kv_blocks is not None:
        return engine.num_kv_blocks
    if kv_bytes_per_token <= 0:
        raise ValueError("the profile does not give the KV bytes per token: set engine.num_kv_blocks in the config")
    block_bytes_per_rank = engine.block_size * kv_bytes_per_token / ranks
    return max(1, int(engine.kv_cache_memory_bytes // block_bytes_per_rank))


# ---- one instance --------------------------------------------------------------------------------
class SimInstance:
    """An engine: the real scheduler, steps timed by the latency model, inputs between steps."""

    def __init__(self, instance_id: str, pool: SimPool, sim: "Simulator"):
        self.instance_id = instance_id
        self.sim = sim
        self.become(pool)
        self.pending: deque[Callable[[float], None]] = deque()  # inputs waiting for a step boundary
        self.busy = False
        self.generation = 0  # invalidates a step-end event when a run of decode steps is cut short
        self.step: SchedulerOutput | None = None
        self.run: list = []  # [start, batch, context sum, steps] of a run of plain decode steps
        self.step_ms = 0.0
        # The step (or run) under way in the time the profile gives it alone: its kind as
        # HostSharing tells them (None: not computing), how much of it is done at `since`, at
        # what speed it goes on (below 1 while the host is shared).
        self.activity: str | None = None
        self.work_ms = self.done_ms = 0.0
        self.since = 0.0
        self.speed = 1.0
        self.queued_tokens = 0  # prompt tokens sent and not yet through their prefill (the router's view)
        self.reserve_queue: deque[_Flight] = deque()  # "queue" admission: waiting for room, in order
        self.num_reserved = 0  # inputs that will add a request
        self.link_free_at = 0.0  # a prefill instance sends one request's KV at a time: its link's queue

    def become(self, pool: SimPool, step_model: StepModel | None = None) -> None:
        """Serve in `pool` from now on, with an empty engine of its role (a role switch: the
        re-planner's, disagg.planner.replan_sim); `step_model`: its own, where it differs from
        the pool's (a live instance's fit: disagg.planner.live_pricing)."""
        self.pool = pool
        self.role = Role(pool.role)
        self.step_model = step_model or pool.step_model
        self.scheduler = Scheduler(
            BlockManager(
                pool.num_kv_blocks, pool.block_size, enable_prefix_caching=False, sliding_window=pool.sliding_window
            ),
            role=self.role,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            max_num_seqs=pool.max_num_seqs,
            max_waiting_requests=pool.max_waiting_requests,
            max_model_len=pool.max_model_len,
            policy=pool.scheduling_policy,
            order=pool.scheduling_order,
            priority_aging_s=pool.priority_aging_s,
            long_prefill_token_threshold=pool.long_prefill_token_threshold,
            attention_context_tokens=self.step_model.attention_context_tokens if pool.long_prefill_by_work else None,
            clock=self._virtual_time,  # waits age on the simulated clock, not the replay's wall time
        )

    def _virtual_time(self) -> float:
        return self.sim.now

    @property
    def is_idle(self) -> bool:
        """Nothing computing, queued, held for a transfer or on its way here."""
        s = self.scheduler
        return not (self.busy or self.pending or self.num_reserved or s.has_unfinished_requests() or s.held_for_export)

    # the load a placement policy reads (disagg.placement.policies.InstanceLoad)
    @property
    def queued_prefill_tokens(self) -> int:
        return self.queued_tokens

    @property
    def num_requests(self) -> int:
        s = self.scheduler
        return len(s.running) + len(s.waiting) + len(s.waiting_for_kv) + len(s.suspended) + self.num_reserved

    @property
    def free_blocks(self) -> int:
        return self.scheduler.block_manager.num_free_blocks

    # what the goodput policy predicts from (disagg.placement.predictor): the simulated steps
    # are the model's own, so its predictions miss nothing a residual would learn
    prefill_calibrated = decode_calibrated = True

    def ttft_residual_ms(self, model_ms: float) -> float:
        return 0.0

    def tpot_residual_ms(self, model_ms: float) -> float:
        return 0.0

    @property
    def prefill_budget(self) -> int:
        return self.pool.max_num_batched_tokens

    @property
    def prefill_chunk_cap(self) -> int:
        return self.scheduler.chunk_cap

    @property
    def prefill_by_work(self) -> bool:
        return self.pool.long_prefill_by_work

    @property
    def predicted_queue_tokens(self) -> int:
        return self.queued_tokens

    @property
    def queued_prompts(self) -> list[QueuedPrompt]:
        """The prompts not through their prefill: in its scheduler, with the chunks they have
        computed (the running ones first, as it schedules them: in the step under way), then
        the waiting ones and those delivered and not taken yet, which came while it ran."""
        s = self.scheduler
        running = [QueuedPrompt(r.num_tokens, r.num_computed_tokens) for r in s.running if self._prefilling(r)]
        waiting = [QueuedPrompt(r.num_tokens, r.num_computed_tokens, age_ms=0.0) for r in s.waiting]
        in_scheduler = [r for r in (*s.running, *s.waiting) if self._prefilling(r) and not r.num_output_tokens]
        delivered = self.queued_tokens - sum(r.num_prompt_tokens for r in in_scheduler)
        return running + waiting + self._delivered(delivered)

    @property
    def queue_progress_ms(self) -> float:
        """Of a step under way with prompt chunks (not counted computed until it ends): half, on
        average, for a request arriving at any moment of it."""
        prefilling = self.busy and not self.run and self.step is not None and self.step.work.chunks
        return self.step_ms / 2 if prefilling else 0.0

    backlog_tokens = 0  # its queue is known whole

    @property
    def arriving_tokens_per_ms(self) -> float:
        """The rate its queue came in: its prompts, and one more like them (the one arriving
        now), over the age of the oldest (or the time spent on the step under way, if longer)."""
        s = self.scheduler
        queued = [r for r in (*s.running, *s.waiting) if self._prefilling(r) and not r.num_output_tokens]
        if not queued:
            return 0.0
        tokens = sum(r.num_prompt_tokens for r in queued)
        span_ms = max((self.sim.now - min(r.arrival_time for r in queued)) * 1e3, self.queue_progress_ms, 1e-3)
        return tokens * (1 + 1 / len(queued)) / span_ms

    @property
    def riding_decodes(self) -> Decodes | None:
        if self.role is Role.PREFILL:
            return None
        decoding = [r for r in self.scheduler.running if not self._prefilling(r)]
        return Decodes(len(decoding), sum(r.num_tokens for r in decoding))

    def _delivered(self, tokens: int) -> list[QueuedPrompt]:
        """Prompts delivered and not taken yet: `tokens` in all, about one per input waiting."""
        if tokens <= 0:
            return []
        count = max(1, min(self.num_reserved, tokens))
        return [QueuedPrompt(tokens // count + (i < tokens % count), age_ms=0.0) for i in range(count)]

    @staticmethod
    def _prefilling(request: Request) -> bool:
        """Prompt tokens left to compute: its prompt, or after a preemption, all it had."""
        return request.num_tokens - request.num_computed_tokens > (1 if request.num_output_tokens else 0)

    @property
    def decode_batch(self) -> int:
        return self.num_requests

    @property
    def decode_context_tokens(self) -> int:
        s = self.scheduler
        return sum(r.num_tokens for r in s.running) + sum(r.num_tokens for r in s.waiting_for_kv)

    def cached_tokens(self, block_hashes) -> int:
        return 0  # prefix caching is not modelled

    # ---- inputs ------------------------------------------------------------------------------
    def deliver(self, now: float, apply: Callable[[float], None]) -> None:
        """Hand the engine an input; it is applied at the next step boundary (now, if idle)."""
        self.pending.append(apply)
        if self.run:
            self._cut_run(now)
        elif not self.busy:  # wake after every other event of this instant: simultaneous arrivals share a step
            self.busy = True
            self.generation += 1
            self.sim.at(now, self._boundary_event, self.generation)

    def _cut_run(self, now: float) -> None:
        _, batch, context, steps = self.run
        elapsed_ms = self._progress_ms(now)
        done = self.step_model.decode_steps_within(batch, context, elapsed_ms)
        if done + 1 < steps:  # the step under way finishes; the rest of the run is cancelled
            self.run[3] = done + 1
            self.work_ms = self.step_model.decode_steps_ms(batch, context, done + 1)
            self.done_ms, self.since = elapsed_ms, now
            self._schedule_end(now)

    def _boundary_event(self, now: float, generation: int) -> None:
        if generation == self.generation:
            self._boundary(now)
            self._host_may_have_changed(now, was=None)

    def _boundary(self, now: float) -> None:
        while self.pending:
            self.pending.popleft()(now)
        self.sim.admit_queued(self, now)
        self._start_step(now)

    # ---- steps -------------------------------------------------------------------------------
    def _start_step(self, now: float) -> None:
        steps = self.scheduler.plain_decode_steps()
        if steps > 1:
            running = self.scheduler.running
            batch, context = len(running), sum(r.num_tokens for r in running)
            self.run = [now, batch, context, steps]
            duration_ms = self.step_model.decode_steps_ms(batch, context, steps)
        else:
            self.run = []
            self.step = self.scheduler.schedule()
            if self.step.is_empty:
                self.busy, self.activity = False, None
                return
            duration_ms = self._step_ms(self.step)
        self.busy, self.activity = True, sharing_kind(self.step.work if not self.run else None)
        self.step_ms = duration_ms
        self.work_ms, self.done_ms, self.since = duration_ms, 0.0, now
        self.speed = self.sim.speed_of(self)
        self._schedule_end(now)

    # ---- a host shared with other instances (disagg.placement.latency_model.HostSharing) ---------
    def _progress_ms(self, now: float) -> float:
        """Of the step or run under way, the part done by `now`, in the time it takes alone."""
        return self.done_ms + (now - self.since) * 1e3 * self.speed

    def _schedule_end(self, now: float) -> None:
        self.generation += 1
        self.sim.at(now + (self.work_ms - self.done_ms) / self.speed / 1e3, self._step_done, self.generation)

    def respeed(self, now: float) -> None:
        """Another instance of the host started or stopped computing: go on at the new speed."""
        if self.activity is None or (speed := self.sim.speed_of(self)) == self.speed:
            return
        self.done_ms, self.since, self.speed = self._progress_ms(now), now, speed
        self._schedule_end(now)

    def _host_may_have_changed(self, now: float, was: str | None) -> None:
        if self.activity != was:
            self.sim.host_changed(self, now)

    def _step_ms(self, out: SchedulerOutput) -> float:
        return self.step_model.step_ms(out.work)  # the step as the engine describes it to the router

    def _step_done(self, now: float, generation: int) -> None:
        if generation != self.generation:
            return  # a run that was cut short: its new end has its own event
        if self.run:
            updated = self.scheduler.advance_decodes(self.run[3], TOKEN)
        else:
            sampled = {c.request.request_id: SampledToken(TOKEN) for c in self.step.chunks if c.samples}
            updated = self.scheduler.update_from_output(self.step, sampled)
            for r in self.step.preempted:
                if (flight := self.sim.flights.get(r.request_id)) is not None:  # (a seeded request has none)
                    flight.record.num_preemptions += 1
        for request in updated:
            self.sim.on_token(self, request, now)
        was, self.activity = self.activity, None
        self._boundary(now)
        self._host_may_have_changed(now, was)


# ---- the system ------------------------------------------------------------------------------
@dataclass
class _Flight:
    """A request on its way through the system."""

    sim_request: SimRequest
    record: SimRecord
    prefill: SimInstance | None = None
    decode: SimInstance | None = None
    prefill_end: float | None = None
    prefill_step_ms: float = 0.0
    reserved_at: float | None = None
    chosen_decode: SimInstance | None = None  # the policy's choice, asked first
    backoff: float = RESERVE_RETRY_S
    deadline: float = math.inf
    done: bool = False


@dataclass
class Simulator:
    pools: list[SimPool]
    policy: PlacementPolicy = field(default_factory=LeastOutstandingWork)
    slo: SLO = field(default_factory=SLO)  # every request's targets (the goodput policy places and admits by them)
    transfer: TransferModel = field(default_factory=TransferModel)
    kv_bytes_per_token: int = 0
    num_layers: int = 1
    router_overhead_ms: float = 0.0  # client + frontend + router, before the prefill instance sees the request
    admission_timeout_s: float = 30.0
    decode_admission: str = "retry"  # DECODE_ADMISSIONS
    max_inflight: int | None = None  # the frontend's limit: a request arriving beyond it is refused at once
    # Every instance on one host, its steps slower while another computes (None: separate devices).
    host_sharing: HostSharing | None = None
    on_arrive: Callable[[SimRequest], None] | None = None  # told of each request as it arrives (a re-planner's window)

    def __post_init__(self) -> None:
        roles = {p.role for p in self.pools}
        if self.decode_admission not in DECODE_ADMISSIONS:
            raise ValueError(f"decode_admission: must be one of {DECODE_ADMISSIONS}, got {self.decode_admission!r}")
        if roles not in ({"colocated"}, {"prefill", "decode"}):
            raise ValueError(f"simulator: pools must be colocated, or prefill and decode; got {sorted(roles)}")
        self.instances: dict[str, list[SimInstance]] = {}
        for pool in self.pools:
            self.instances[pool.role] = [SimInstance(f"{pool.role}-{i}", pool, self) for i in range(pool.num_instances)]
        self.disaggregated = "prefill" in roles
        self.flights: dict[str, _Flight] = {}
        self._events: list = []
        self._seq = itertools.count()
        self._seed_ids = itertools.count()
        self.records: list[SimRecord] = []
        self.now = 0.0

    # ---- instances sharing one host -----------------------------------------------------------------
    def speed_of(self, instance: SimInstance) -> float:
        """1 alone; 1 / its step's slowdown beside what the other instances of the host compute."""
        sharing = self.host_sharing
        if sharing is None or not sharing.shares:
            return 1.0
        others = [o.activity for pool in self.instances.values() for o in pool if o is not instance and o.activity]
        return 1.0 / sharing.factor(instance.activity, others)

    def host_changed(self, instance: SimInstance, now: float) -> None:
        if self.host_sharing is None or not self.host_sharing.shares:
            return
        for pool in self.instances.values():
            for other in pool:
                if other is not instance:
                    other.respeed(now)

    # ---- the event loop --------------------------------------------------------------------------
    def at(self, time_s: float, action: Callable, *args) -> None:
        heapq.heappush(self._events, (time_s, next(self._seq), action, args))

    def run(self, requests: list[SimRequest]) -> list[SimRecord]:
        """Simulate the requests (any order; each at its arrival) to the end; records in input order."""
        records = [SimRecord(r.index, r.arrival_s, r.prompt_len, r.output_len, slo=r.slo) for r in requests]
        self.records = records  # as they fill in (a re-planning driver measures the latest from them)
        for sim_request, record in zip(requests, records):
            self.at(sim_request.arrival_s + self.router_overhead_ms / 1e3, self._arrive, sim_request, record)
        events = self._events
        while events:
            self.now, _, action, args = heapq.heappop(events)
            action(self.now, *args)
        for record in records:
            if not record.success and not record.failed:  # a scheduler that could never run it
                record.failed, record.error_code = "did not finish", "INTERNAL"
        return records

    # ---- routing ---------------------------------------------------------------------------------
    def _arrive(self, now: float, sim_request: SimRequest, record: SimRecord) -> None:
        if self.on_arrive is not None:
            self.on_arrive(sim_request)
        request_id = str(record.index)
        flight = _Flight(sim_request, record, deadline=now + self.admission_timeout_s)
        if self.max_inflight is not None and len(self.flights) >= self.max_inflight:
            _refuse(record, f"refused: {self.max_inflight} requests in flight")
            return
        if not self._fits(sim_request, record):
            return
        prefills, decodes = (
            (self.instances["prefill"], self.instances["decode"]) if self.disaggregated else
            (self.instances["colocated"], self.instances["colocated"])
        )  # fmt: skip
        # The router's TPOT prediction takes the predicted length where the request has one (as
        # with `output_length: ranker`), else its own length (what a trace's max_tokens says).
        shape = RequestShape(sim_request.prompt_len, sim_request.output_len, sim_request.slo or self.slo,
                             blocks_needed=self._blocks(sim_request, "decode" if self.disaggregated else "colocated"),
                             expected_output_tokens=sim_request.predicted_output_len)  # fmt: skip
        choice = self.policy.choose_pair(prefills, decodes, shape)
        if not choice.admitted:
            _refuse(record, f"refused: {choice.refusal(self.slo)}")
            return
        self.flights[request_id] = flight
        if not self.disaggregated or choice.local:
            self._start_whole(flight, choice.decode, now)
            return
        prefill = choice.prefill
        flight.prefill, flight.chosen_decode = prefill, choice.decode
        record.prefill_instance = prefill.instance_id
        prefill.queued_tokens += sim_request.prompt_len
        prefill.num_reserved += 1
        prefill.deliver(now, lambda t: self._add(flight, prefill, t))
        if self.decode_admission == "retry":  # the router reserves while the prompt is computed
            self._reserve(now, flight)

    def _start_whole(self, flight: _Flight, instance: SimInstance, now: float) -> None:
        """One instance prefills and decodes: colocated, or a local prefill on a decode instance."""
        flight.decode = instance
        flight.record.decode_instance = instance.instance_id
        if self.disaggregated:
            flight.record.prefill_instance = instance.instance_id
        instance.queued_tokens += flight.sim_request.prompt_len
        instance.num_reserved += 1
        instance.deliver(now, lambda t: self._add(flight, instance, t))

    def _fits(self, sim_request: SimRequest, record: SimRecord) -> bool:
        """As the router validates: a request no instance could ever hold is refused at once."""
        for pool in self.pools:
            try:
                check_fits(
                    sim_request.prompt_len,
                    sim_request.output_len,
                    pool.max_model_len,
                    pool.block_size,
                    pool.num_kv_blocks,
                    max_blocks_held=pool.blocks_held(sim_request.prompt_len + sim_request.output_len),
                )
            except InvalidRequestError as exc:
                record.failed, record.error_code = f"invalid: {exc}", exc.grpc_code_name
                return False
        return True

    def _add(self, flight: _Flight, instance: SimInstance, now: float) -> None:
        instance.num_reserved -= 1
        try:
            instance.scheduler.add_request(self._engine_request(flight))
        except OverloadedError:
            self._fail(flight, now, "waiting queue full")

    def _reserve(self, now: float, flight: _Flight) -> None:
        if flight.done:
            return
        decode = flight.chosen_decode or self.policy.choose_decode(
            self.instances["decode"], self._blocks(flight.sim_request, "decode")
        )
        flight.chosen_decode = None
        decode.num_reserved += 1
        decode.deliver(now, lambda t: self._try_reserve(flight, decode, t))

    def _try_reserve(self, flight: _Flight, decode: SimInstance, now: float) -> None:
        decode.num_reserved -= 1
        if flight.done:
            return
        if self.decode_admission == "queue" and decode.reserve_queue:  # behind those already waiting
            decode.reserve_queue.append(flight)
        elif self._reserved(flight, decode, now):
            return
        elif self.decode_admission == "queue":
            decode.reserve_queue.append(flight)
        elif now + flight.backoff > flight.deadline:
            self._fail(flight, now, "no decode instance had room within the admission timeout")
        else:
            self.at(now + flight.backoff, self._reserve, flight)
            flight.backoff = min(flight.backoff * 2, MAX_RESERVE_RETRY_S)

    def _reserved(self, flight: _Flight, decode: SimInstance, now: float) -> bool:
        if not decode.scheduler.reserve_for_remote_prefill(self._engine_request(flight)):
            return False
        flight.decode, flight.reserved_at = decode, now
        flight.record.decode_instance = decode.instance_id
        self._maybe_transfer(flight, now)
        return True

    def admit_queued(self, decode: SimInstance, now: float) -> None:
        """At a step boundary: the requests waiting for room here, in order, while they fit."""
        queue = decode.reserve_queue
        while queue and (queue[0].done or self._reserved(queue[0], decode, now)):
            queue.popleft()

    def _blocks(self, sim_request: SimRequest, role: str) -> int:
        return self.instances[role][0].pool.prompt_blocks_held(sim_request.prompt_len)

    def _engine_request(self, flight: _Flight) -> Request:
        r = flight.sim_request
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        return Request(
            str(r.index),
            [TOKEN] * r.prompt_len,
            params,
            arrival_time=r.arrival_s,
            priority=r.priority,
            predicted_output_len=r.predicted_output_len,
        )

    # ---- the work the system holds at the start (a live state: disagg.planner.live_pricing) -------
    def seed_decode(self, instance: SimInstance, context_tokens: int, remaining_tokens: int) -> None:
        """A request decoding on `instance` from the start: its KV held, `remaining_tokens` to go.
        Seeded requests are load only: no record judges them."""
        request = self._seed_request(max(1, context_tokens), max(1, remaining_tokens) + 1)

        def start(now: float) -> None:
            if instance.scheduler.reserve_for_remote_prefill(request):
                instance.scheduler.finish_kv_import(request.request_id, TOKEN)

        instance.deliver(0.0, start)

    def seed_prompt(self, instance: SimInstance, prompt_tokens: int) -> None:
        """A prompt queued on a prefill instance from the start (its prefill is the load)."""
        request = self._seed_request(max(1, prompt_tokens), 1)
        instance.queued_tokens += request.num_prompt_tokens
        instance.deliver(0.0, lambda now: instance.scheduler.add_request(request))

    def _seed_request(self, prompt_tokens: int, max_tokens: int) -> Request:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return Request(f"{SEED_PREFIX}{next(self._seed_ids)}", [TOKEN] * prompt_tokens, params, arrival_time=0.0)

    def _seed_token(self, instance: SimInstance, request: Request, now: float) -> None:
        if instance.role is Role.PREFILL and request.num_output_tokens == 1:  # its KV leaves at once
            instance.queued_tokens -= request.num_prompt_tokens
            instance.deliver(now, lambda t: instance.scheduler.release(request.request_id))

    # ---- tokens ------------------------------------------------------------------------------------
    def on_token(self, instance: SimInstance, request: Request, now: float) -> None:
        """A step gave `request` a token (or more, in a run); the instance has applied it."""
        if request.request_id.startswith(SEED_PREFIX):
            self._seed_token(instance, request, now)
            return
        flight = self.flights.get(request.request_id)
        if flight is None or flight.done:
            return
        record = flight.record
        if record.first_token_s is None:
            record.first_token_s = now
            if instance.role is Role.PREFILL:
                instance.queued_tokens -= record.prompt_len
                flight.prefill_end, flight.prefill_step_ms = now, instance.step_ms
                if request.is_finished:  # a one-token request ends at its prefill
                    self._finish(flight, now)
                    self._drop_reservation(flight, now)
                elif self.decode_admission == "queue":  # the decode side takes it from here, in order
                    self._reserve(now, flight)
                else:
                    self._maybe_transfer(flight, now)
                return
            instance.queued_tokens -= record.prompt_len  # prefilled where it decodes
        if request.is_finished:
            self._finish(flight, now)

    def _maybe_transfer(self, flight: _Flight, now: float) -> None:
        """Once the prefill is done and the decode side has its blocks, the KV moves: over the
        prefill instance's link, after the transfers queued on it before."""
        if flight.prefill_end is None or flight.reserved_at is None or flight.done:
            return
        # Under a sliding window only the prompt's last window moves (what the decode side reserved).
        pool = flight.decode.pool
        tokens = min(flight.record.prompt_len, pool.prompt_blocks_held(flight.record.prompt_len) * pool.block_size)
        num_bytes = tokens * self.kv_bytes_per_token / _parallel_links(flight)
        wire_s = num_bytes / self.transfer.bandwidth_bytes_per_s
        layers = max(1, self.num_layers)
        if flight.reserved_at <= flight.prefill_end:  # streamed: layer i left when computed, (i+1)/L into the step
            earliest = now - flight.prefill_step_ms / 1e3 * (layers - 1) / layers
            last_layer = now + wire_s / layers
        else:  # the KV waited in the prefill's blocks for somewhere to go
            earliest = last_layer = now
        link = flight.prefill
        start = max(earliest, link.link_free_at)
        link.link_free_at = end = max(start + wire_s, last_layer)
        self.at(end + self.transfer.latency_ms / 1e3, self._kv_arrived, flight)

    def _kv_arrived(self, now: float, flight: _Flight) -> None:
        request_id = str(flight.record.index)
        flight.prefill.deliver(now, lambda t: flight.prefill.scheduler.release(request_id))
        if not flight.done:
            flight.decode.deliver(now, lambda t: flight.decode.scheduler.finish_kv_import(request_id, TOKEN))

    def _finish(self, flight: _Flight, now: float) -> None:
        flight.record.finish_s = now
        flight.done = True
        self.flights.pop(str(flight.record.index), None)

    def _drop_reservation(self, flight: _Flight, now: float) -> None:
        if flight.decode is not None:
            request_id = str(flight.record.index)
            flight.decode.deliver(now, lambda t: flight.decode.scheduler.finish_request(request_id, ABORTED))

    def _fail(self, flight: _Flight, now: float, why: str) -> None:
        """Shed after admission (no decode room in time, a full waiting queue): the server's
        OverloadedError."""
        flight.record.failed, flight.record.error_code = why, OverloadedError.grpc_code_name
        flight.done = True
        request_id = str(flight.record.index)
        for instance in {flight.prefill, flight.decode} - {None}:
            instance.deliver(now, lambda t, i=instance: i.scheduler.finish_request(request_id, ABORTED))
        self.flights.pop(request_id, None)


def _refuse(record: SimRecord, why: str) -> None:
    """Refused at admission, as the server answers RESOURCE_EXHAUSTED."""
    record.failed, record.error_code = why, OverloadedError.grpc_code_name


def _parallel_links(flight: _Flight) -> int:
    """Each rank pair moves its own slice of the KV, side by side."""
    return max(1, min(flight.prefill.pool.ranks, flight.decode.pool.ranks))


# ---- what came out ------------------------------------------------------------------------------
def percentile(values: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), in pure Python."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = (len(ordered) - 1) * pct / 100
    lo, hi = math.floor(k), math.ceil(k)
    if lo == hi:
        return ordered[lo]
    if math.isinf(ordered[hi]):  # a failed request: its latency is unbounded
        return math.inf
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def slo_attainment(records: list[SimRecord], slo: SLO = SLO()) -> float:
    """Percent of all requests (failures count as misses) that met `slo` (disagg.slo.met)."""
    return 100.0 * num_met(records, slo) / len(records) if records else 0.0


def num_met(records: list[SimRecord], slo: SLO) -> int:
    """How many of `records` succeeded and met their own SLO, or else `slo` (disagg.slo.met)."""
    return sum(1 for r in records if r.success and met(getattr(r, "slo", None) or slo, r.ttft_s * 1e3, r.tpot_s * 1e3))
