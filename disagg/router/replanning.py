"""The closed loop: the server re-plans its prefill:decode split as the traffic shifts (issue 36).

Every `replan_interval_s` the loop hands the re-planner (disagg.planner.replanner) the requests
that arrived in the last `replan_window_s`, as the frontend saw them (arrival, prompt length,
output asked for). The re-planner replays them with the simulator on every reachable split and
says when a switch is worth it, with hysteresis. A switch moves one instance:

1. out of placement at once (held out here; its report says "draining" a heartbeat later,
   and the server's drain task then moves its decoding requests away with their KV);
2. once it holds nothing, its engine thread rebuilds it in the other role around the same
   weights (disagg.worker.actor.WorkerActor.switch_role);
3. back into placement; the directory finds it in its new pool with its next heartbeat.

A switch that cannot finish (the instance still held requests at the deadline, or refused)
puts the instance back in service in its old role. Each round prices the splits from the live
state (issue 53): every instance's queued prompts and running decodes, each with its own fitted
step model times the host factor its measured steps show (disagg.planner.live_state); the
window's requests carry the output length the router expects (its `output_length` source), their
own SLO and priority. The simulations run in a process of their own (replan_pricer). Until a
profile or both roles' fits exist the loop only watches.

Scale, not only switch (issue 53, item 3; disagg.planner.scaling): where the controller can launch
instances (`scaler`), each round also prices one instance more in each pool that the cluster has
room for, and one fewer in each pool of two or more, and adds or removes one when that beats
staying (the cluster's room asked of Ray each round). A window too light to choose a split by
(its arrivals and the requests the instances hold fewer than MIN_WINDOW_REQUESTS, or no arrival:
the traffic stopped) prices the removals alone. A removed
instance is drained as a switch drains it (its decodes move with their KV, its prompts finish)
before the launcher stops it.

Every switch and scale step is checked (disagg.planner.decision_check): once the hold after it is over, the
attainment and goodput measured since the instance serves in its new role are compared with
staying; a switch that measured worse is undone (and its split vetoed for a while), and the miss
is learnt as a residual of the split that served. Decisions, their predictions and what was measured are
kept for `disagg status`, counted in the metrics and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from disagg.config import ServingConfig
from disagg.engine.memory_fit import kv_element_bytes
from disagg.errors import RegistryUnavailable
from disagg.metrics import ServingMetrics
from disagg.placement.latency_model import StepModel
from disagg.placement.profile import Profile, load_profile
from disagg.planner.decision_check import Check, DecisionChecker
from disagg.planner.live_pricing import SWITCH_S, Price, price_splits
from disagg.planner.live_state import LiveDecode, LiveInstance, LiveState, enough_to_price, host_factor
from disagg.planner.replanner import (
    MIN_WINDOW_REQUESTS, Decision, Replanner, Split, TrafficWindow, reachable_splits, split_simulator,
)  # fmt: skip
from disagg.planner.scaling import ScaleBounds, ScalePolicy, ScaleStep, candidates
from disagg.router.directory import Instance, InstanceDirectory
from disagg.router.replan_pricer import PricingBusy, PricingPool
from disagg.slo import SLO
from disagg.step_work import MeasuredStep

if TYPE_CHECKING:  # (torch, behind it, would slow every start of the controller that runs this)
    from disagg.engine.model_card import ModelCard

logger = logging.getLogger(__name__)
IDLE_POLL_S = 0.1
# A frontend sees a drain at its next read of the registry (the draining worker beats at once);
# until then it may still place a prompt there, which the instance, switched, would refuse (the
# request is placed again: nothing lost, a round trip late). A switch waits that long, and this.
DRAIN_SEEN_MARGIN_S = 0.2
UNDO_VETO_WINDOWS = 3  # an undone switch's split is not chosen again for this many windows
REGISTER_TIMEOUT_S = 10.0  # for the directory to find the instance in its new pool
ROLES = ("prefill", "decode")


class Scaler(Protocol):
    """What launches and stops instances for the loop (the controller's launcher); blocking calls,
    run on a thread."""

    def room_for(self, role: str) -> bool: ...

    def add(self, role: str): ...  # -> a launched instance, ready (its `instance_id`)

    def remove(self, instance_id: str) -> None: ...


@dataclass
class SwitchRecord:
    """One instance moved from a pool to the other (or not, `outcome` "failed"); a scale step
    too (`kind` "add": `from_role` empty; "remove": `to_role` empty)."""

    at: float  # time.time() of the decision
    instance_id: str
    from_role: str
    to_role: str
    kind: str = "switch"  # switch | add | remove
    outcome: str = "running"  # running | done | failed
    seconds: float = 0.0  # from the decision to serving in the new role (or to giving up)
    reason: str = ""


@dataclass
class LoggedDecision:
    at: float  # time.time()
    decision: Decision
    switch: SwitchRecord | None = None
    check: Check | None = None  # the switch checked against the window after it


@dataclass
class ReplanView:
    """The controller's latest re-planning decisions as a frontend last fetched them (for
    `disagg status`: ClusterStatus shows `log`)."""

    log: list[LoggedDecision] = field(default_factory=list)


def replans(config: ServingConfig) -> bool:
    """Re-planning runs where instances may switch (ServingConfig.switchable) and there is a
    split to choose (three instances or more), or where it may scale (ServingConfig.scales: the
    default 1 + 1 deployment too)."""
    switches = config.switchable() and config.prefill.num_instances + config.decode.num_instances >= 3
    return switches or config.scales()


def scale_bounds(config: ServingConfig) -> ScaleBounds:
    return ScaleBounds(config.replan_max_instances, config.replan_max_total_instances, config.replan_pd_ratio)


def replan_loop_for(
    config: ServingConfig, directory: InstanceDirectory, card: ModelCard, metrics: ServingMetrics,
    on_switched: Callable[[str, str], None], shared_arrivals: Callable[[], list[tuple]],
    scaler: Scaler | None = None, shared_verdicts: Callable[[], list[tuple[float, bool]]] | None = None,
) -> ReplanLoop | None:  # fmt: skip
    """The closed loop the controller runs, fed every frontend's arrivals (`shared_arrivals`) and
    SLO verdicts (`shared_verdicts`), scaling through `scaler` (the launcher); None where it would
    not run (replans)."""
    if not replans(config):
        return None
    base = load_profile(config.profile) if config.profile else None
    kv_bytes = card.config.kv_bytes_per_token * (card.kv_element_bytes or kv_element_bytes(config.engine))
    layers = card.config.num_hidden_layers

    def profile():
        return live_profile(base, directory, config.engine.model, kv_bytes, layers)

    return ReplanLoop(config, directory, profile, metrics, on_switched, shared_arrivals=shared_arrivals,
                      scaler=scaler, shared_verdicts=shared_verdicts)  # fmt: skip


def live_profile(base: Profile | None, directory: InstanceDirectory, model: str, kv_bytes_per_token: int,
                 num_layers: int) -> Profile | None:  # fmt: skip
    """The step model the simulator prices with: the prefill side fitted on a calibrated prefill
    instance, the decode side on a calibrated decode instance (every instance runs the same
    engine); what is not fitted yet comes from `base` (the configured profile). None while
    neither says anything."""
    fitted = {role: [i for i in directory.healthy(role) if _calibrated_in(i, role)] for role in ROLES}
    seed = base.step_model(1, 1) if base is not None and base.has(1, 1) else None
    prefill = fitted["prefill"][0].online.model.prefill if fitted["prefill"] else seed and seed.prefill
    decode = fitted["decode"][0].online.model if fitted["decode"] else seed
    if prefill is None or decode is None:
        return None
    step = StepModel(prefill, decode.decode_small, decode.decode_large, decode.decode_threshold, experts=decode.experts)
    if base is not None:
        return replace(base, entries={(1, 1): step})
    return Profile(model, "this host (fitted online)", "measured", {(1, 1): step}, kv_bytes_per_token, num_layers)


def _calibrated_in(instance: Instance, role: str) -> bool:
    return instance.prefill_calibrated if role == "prefill" else instance.decode_calibrated


# ---- the live state a round prices from ---------------------------------------------------------
def live_state(directory: InstanceDirectory, profile: Profile, typical_remaining: int) -> LiveState:
    """Every healthy instance with its own model (times its host factor), queue and decodes;
    `typical_remaining`: the output left to a decode whose report does not say (an older worker)."""
    seed = profile.step_model(1, 1)
    return LiveState(tuple(
        live_instance(instance, role, seed, typical_remaining) for role in ROLES for instance in directory.healthy(role)
    ))  # fmt: skip


def live_instance(instance: Instance, role: str, seed: StepModel, typical_remaining: int) -> LiveInstance:
    model = own_model(instance, seed)
    model = model.scaled(host_factor(measured_steps(instance.view.load.steps), model))
    return LiveInstance(
        instance.instance_id,
        role,
        model,
        queued_prompts(instance),
        running_decodes(instance.view.load, typical_remaining),
    )


def own_model(instance: Instance, seed: StepModel) -> StepModel:
    """Each side of the instance's step model from its own fit where calibrated, else from `seed`
    (the profile's): not the first calibrated instance's of its role."""
    fitted = instance.online.model
    prefill = fitted.prefill if instance.prefill_calibrated else seed.prefill
    decode = fitted if instance.decode_calibrated else seed
    return StepModel(prefill, decode.decode_small, decode.decode_large, decode.decode_threshold, experts=decode.experts)


def measured_steps(reported: list) -> list[MeasuredStep]:
    steps = []
    for values in reported:
        try:
            steps.append(MeasuredStep.from_list(values))
        except (TypeError, ValueError):  # a malformed entry prices nothing
            continue
    return steps


def queued_prompts(instance: Instance) -> tuple[int, ...]:
    """What this router sent and has not seen the first token of, and its report's backlog
    beyond that (another frontend's prompts, or preempted ones)."""
    prompts = [p.num_new for p in instance.queued_prompts if p.num_new > 0]
    return tuple(prompts + ([instance.backlog_tokens] if instance.backlog_tokens > 0 else []))


def running_decodes(load, typical_remaining: int) -> tuple[LiveDecode, ...]:
    """Its report's decodes ([context, tokens left] each), or where it lists none, its running
    count at their mean context with `typical_remaining` to go."""
    if load.decodes:
        return tuple(LiveDecode(int(c), int(r)) for c, r in load.decodes)
    if not load.num_running:
        return ()
    context = max(1, load.decode_context_tokens // load.num_running)
    return tuple(LiveDecode(context, typical_remaining) for _ in range(load.num_running))


class ReplanLoop:
    def __init__(
        self,
        config: ServingConfig,
        directory: InstanceDirectory,
        profile: Callable[[], Profile | None],
        metrics: ServingMetrics,
        on_switched: Callable[[str, str], None] = lambda instance_id, role: None,
        shared_arrivals: Callable[[], list[tuple]] | None = None,
        pricer: PricingPool | None = None,
        scaler: Scaler | None = None,
        shared_verdicts: Callable[[], list[tuple[float, bool]]] | None = None,
    ):
        """`profile()`: what the simulator prices with now (live_profile); `on_switched(id,
        role)`: an instance serves in its new role (the launcher's records follow);
        `shared_arrivals()`: the other frontends' arrivals since the last call, as `arrived`
        takes them (disagg.router.shared_arrivals), taken before each round; `pricer`: where the
        simulations run (a process of their own by default); `scaler`: what adds and removes
        instances (None: the loop only switches); `shared_verdicts()`: the frontends' SLO verdicts
        since the last call, (time.monotonic(), met), which a decision's check measures (None:
        those `metrics` observed, where the loop runs beside a frontend)."""
        self.config, self.directory, self.profile, self.metrics = config, directory, profile, metrics
        self.pricer = pricer or PricingPool(config.replan_price_timeout_s)
        self.checker = DecisionChecker(margin=config.replan_undo_margin)
        self.on_switched = on_switched
        self.shared_arrivals = shared_arrivals
        self.shared_verdicts = shared_verdicts
        self.window = TrafficWindow(config.replan_window_s)
        self.total = config.prefill.num_instances + config.decode.num_instances
        self.replanner = Replanner(
            self._simulate, self.total, config.slo,
            min_gain=config.replan_min_gain, hold_s=config.replan_hold_s,
        )  # fmt: skip
        self.scaler = scaler if config.scales() else None
        self.scaling = ScalePolicy(scale_bounds(config), config.replan_min_gain, hold_s=config.replan_hold_s)
        self.log: deque[LoggedDecision] = deque(maxlen=64)  # the latest decisions, for `disagg status`
        self.switches: list[SwitchRecord] = []
        self._profile: Profile | None = None

    def arrived(
        self, at: float, prompt_tokens: int, output_tokens: int, slo: SLO | None = None, priority: int = 0
    ) -> None:
        """A request arrived (the orchestrator's ArrivalListener)."""
        self.window.add(at, prompt_tokens, output_tokens, slo, priority)

    def resize(self, total: int) -> None:
        """The deployment has `total` instances now (a scale step; a restarted controller that
        adopted the ones added before)."""
        self.total = total
        self.replanner.total_instances = total

    def current_split(self) -> Split | None:
        """The split in placement now; None while an instance is away (failed, draining)."""
        split = Split(len(self.directory.healthy("prefill")), len(self.directory.healthy("decode")))
        return split if split.prefill + split.decode == self.total else None

    async def run(self) -> None:
        """Rounds every replan_interval_s; a round that raises ends it (disagg.supervision restarts
        it, counted). Its pricing process ends with it."""
        try:
            while True:
                await asyncio.sleep(self.config.replan_interval_s)
                await self.step()
        finally:
            self.pricer.close()

    async def step(self) -> LoggedDecision | None:
        """One round: check the last switch once its window is over (and undo it if it measured
        worse than staying); else decide, and switch if the decision says so. Returns what was
        logged."""
        await self._take_shared_arrivals()
        await self._take_shared_verdicts()
        current = self.current_split()
        self._profile = self.profile()
        if current is None or self._profile is None:
            return None
        now = time.monotonic()
        if (check := self.checker.pending) is not None and check.due(now, self.config.replan_hold_s):
            return await self._check(check, current, now)
        requests = self.window.for_pricing(now)
        room = await self._room()
        splits = self._splits(current, room)
        if len(splits) < 2:  # nothing to choose (no room to grow, none to switch or shed): no pricing
            return None
        if not enough_to_price(len(requests), self._held()):  # too little to choose a split by,
            room, splits = {}, self._removals(current)  # not to see that the load fits in fewer
        priced = await self._price(self._live(requests), requests, splits) if len(splits) > 1 else {}
        if priced is None:
            return None
        priced = {split: self.checker.corrected(split, price) for split, price in priced.items()}
        same_size = {split: price for split, price in priced.items() if _size(split) == _size(current)}
        attainment = {split: price.attainment for split, price in same_size.items()} or None
        decision = self.replanner.decide(now, current, self.window, attainment)
        decision.predicted_goodput = {split: price.goodput for split, price in same_size.items()}
        if decision.switch_to is None and self.scaler is not None and priced:
            if (step := self.scaling.decide(now, current, priced, room)) is not None:
                return await self._act_scale(decision, step, current, priced)
        return await self._act(decision, current, priced)

    def _splits(self, current: Split, room: dict[str, bool]) -> list[Split]:
        """What a round prices: every split of these instances (where they may switch) and every
        scale step allowed now."""
        switches = self.config.switchable() and _size(current) >= 3
        splits = reachable_splits(_size(current)) if switches else [current]
        if self.scaler is not None:
            splits += [split for _, _, split in candidates(current, self.scaling.bounds, room) if split not in splits]
        return splits

    def _removals(self, current: Split) -> list[Split]:
        """The split now and each with one instance fewer (what a light window may price)."""
        if self.scaler is None:
            return [current]
        return [current, *(split for _, delta, split in candidates(current, self.scaling.bounds, {}) if delta < 0)]

    async def _room(self) -> dict[str, bool]:
        """Which pools the cluster has room to grow by a whole instance (none without a scaler,
        or where Ray does not answer)."""
        if self.scaler is None:
            return {}
        try:
            return {role: await asyncio.to_thread(self.scaler.room_for, role) for role in ROLES}
        except Exception as exc:  # noqa: BLE001 - this round prices no add
            logger.warning("re-plan: the cluster's room is unknown (%s)", exc)
            return {}

    async def _act(self, decision: Decision, current: Split, priced: dict[Split, Price]) -> LoggedDecision:
        self.metrics.observe_replan(decision.switch_to is not None, decision.gain)
        entry = LoggedDecision(time.time(), decision)
        self.log.append(entry)
        if decision.switch_to is None:
            logger.debug("re-plan at %s: %s", current, decision.reason)
            return entry
        logger.info("re-plan: switching toward %s (%s)", decision.best, decision.reason)
        self.scaling.acted(decision.now)
        entry.switch = await self._move(current, decision.switch_to)
        self._open_check(entry, current, decision.switch_to, priced)
        return entry

    async def _act_scale(self, decision: Decision, step: ScaleStep, current: Split,
                         priced: dict[Split, Price]) -> LoggedDecision:  # fmt: skip
        """A scale step, logged as a decision whose best is the split it reaches."""
        predicted = {**decision.predicted, **{s: priced[s].attainment for s in (current, step.target)}}
        goodput = {**decision.predicted_goodput, **{s: priced[s].goodput for s in (current, step.target)}}
        scaled = Decision(decision.now, current, step.target, predicted, step.target, step.reason, goodput)
        self.metrics.observe_replan(True, scaled.gain)
        entry = LoggedDecision(time.time(), scaled)
        self.log.append(entry)
        logger.info("re-plan: %s", step.reason)
        self.replanner.undone(decision.now)  # the hold after a step, for switches too
        entry.switch = await self.scale(step.role, step.delta)
        self._open_check(entry, current, step.target, priced)
        return entry

    def _open_check(self, entry: LoggedDecision, before: Split, after: Split, priced: dict[Split, Price]) -> None:
        if entry.switch is None or entry.switch.outcome != "done" or after not in priced or before not in priced:
            return
        entry.check = Check(entry.decision.now, before, after, priced[after], priced[before], opens_at=time.monotonic())
        self.checker.open(entry.check)

    async def _move(self, current: Split, target: Split) -> SwitchRecord | None:
        """One step from `current` toward `target`: a switch between pools of the same size, else
        one instance added or removed."""
        if _size(target) != _size(current):
            grows = target.prefill > current.prefill or target.decode > current.decode
            changed = "prefill" if target.prefill != current.prefill else "decode"
            return await self.scale(changed, 1 if grows else -1)
        from_role = "prefill" if target.prefill < current.prefill else "decode"
        return await self.switch(from_role, "decode" if from_role == "prefill" else "prefill")

    # ---- pricing ---------------------------------------------------------------------------------
    def _held(self) -> int:
        """The requests the instances reported holding (running or waiting)."""
        loads = [i.view.load for role in ROLES for i in self.directory.healthy(role)]
        return sum(load.num_running + load.num_waiting for load in loads)

    def _live(self, requests: list) -> LiveState:
        outputs = sorted(r.output_len for r in requests)
        typical_remaining = max(1, outputs[len(outputs) // 2] // 2) if outputs else 1
        return live_state(self.directory, self._profile, typical_remaining)

    async def _price(self, live: LiveState | None, requests: list, splits: list[Split]) -> dict[Split, Price] | None:
        """`splits`' prices, in the pricing process; None when the round cannot have one."""
        profiles = {role: self._profile for role in ROLES}
        try:
            return await self.pricer.run(
                price_splits, self.config, profiles, live, requests, self.config.replan_window_s, SWITCH_S, splits
            )
        except PricingBusy:
            logger.debug("re-plan round skipped: the previous one is still pricing")
        except (TimeoutError, asyncio.TimeoutError):
            logger.warning("re-plan round priced nothing in %.0f s", self.config.replan_price_timeout_s)
        return None

    # ---- checking a switch -------------------------------------------------------------------------
    async def _check(self, check: Check, current: Split, now: float) -> LoggedDecision | None:
        """Once the hold after the switch is over: measured against staying; undone if worse."""
        met, judged = self.metrics.slo_outcomes(check.opens_at, now)
        requests = self.window.requests(now, since=check.opens_at, at_least=MIN_WINDOW_REQUESTS)
        readiness = check.readiness(now, self.config.replan_hold_s, judged, len(requests))
        if readiness == "wait":  # too few to measure yet: no other decision before it closes
            return None
        if readiness == "unmeasured":
            check.outcome = "unmeasured"
            self.metrics.observe_replan_check(check.outcome, check.predicted.goodput, None)
            return None
        priced = await self._price(None, requests, [check.before, check.after])
        if priced is None:
            return None
        measured = Price(100.0 * met / judged, met / (now - check.opens_at))
        outcome = self.checker.close(check, measured, priced)
        self.metrics.observe_replan_check(outcome, check.predicted.goodput, measured.goodput)
        logger.info("re-plan check of %s -> %s: measured %.1f%% against %.1f%% staying: %s", check.before,
                    check.after, measured.attainment, check.stay.attainment, outcome)  # fmt: skip
        if outcome != "undone" or current != check.after:
            return None
        return await self._undo(check, current, now)

    async def _undo(self, check: Check, current: Split, now: float) -> LoggedDecision:
        self.replanner.veto(check.after, now + UNDO_VETO_WINDOWS * self.config.replan_window_s)
        self.scaling.veto(check.after, now + UNDO_VETO_WINDOWS * self.config.replan_window_s)
        self.replanner.undone(now)
        self.scaling.acted(now)
        gain = check.stay.attainment - check.measured.attainment
        back = current.toward(check.before) if _size(current) == _size(check.before) else check.before
        decision = Decision(now, current, check.before, {}, back,
                            f"undo: {check.after} measured {gain:.1f} points under staying at {check.before}")  # fmt: skip
        self.metrics.observe_replan(True, gain)
        entry = LoggedDecision(time.time(), decision, check=check)
        self.log.append(entry)
        logger.warning("re-plan: %s", decision.reason)
        entry.switch = await self._move(current, check.before)
        return entry

    async def _take_shared_arrivals(self) -> None:
        if self.shared_arrivals is None:
            return
        try:
            arrivals = await asyncio.to_thread(self.shared_arrivals)
        except RegistryUnavailable as exc:  # this round plans on what it took before
            logger.warning("re-plan without the other frontends' arrivals: %s", exc)
            return
        for at, prompt_tokens, output_tokens, slo, priority in arrivals:
            self.window.add(at, prompt_tokens, output_tokens, slo, priority)

    async def _take_shared_verdicts(self) -> None:
        if self.shared_verdicts is None:
            return
        try:
            verdicts = await asyncio.to_thread(self.shared_verdicts)
        except RegistryUnavailable as exc:  # a check due now measures on fewer
            logger.warning("re-plan without the frontends' SLO verdicts: %s", exc)
            return
        for at, met in verdicts:
            self.metrics.observe_slo("shared", met, now=at)

    def _simulate(self, split: Split, requests: list) -> list:
        return split_simulator(self.config, {role: self._profile for role in ROLES})(split, requests)

    # ---- one switch ------------------------------------------------------------------------------
    async def switch(self, from_role: str, to_role: str) -> SwitchRecord | None:
        """Moves the least busy instance of `from_role` to `to_role` (never the last of a pool)."""
        pool = self.directory.healthy(from_role)
        if len(pool) < 2:
            return None
        leaving = min(pool, key=lambda i: (i.view.load.num_running + i.view.load.num_waiting, i.instance_id))
        record = SwitchRecord(time.time(), leaving.instance_id, from_role, to_role)
        self.switches.append(record)
        started = time.monotonic()
        self.directory.hold_out(leaving.instance_id)
        try:
            await self._call(leaving.actor.drain.remote())
            seen_at = time.monotonic() + self.directory.refresh_interval_s + DRAIN_SEEN_MARGIN_S
            record.outcome, record.reason = await self._switch_when_idle(leaving, to_role, seen_at)
            await self._call(leaving.actor.resume_service.remote())
            if record.outcome == "done":
                await self._until_registered(leaving.instance_id, to_role)
                self.on_switched(leaving.instance_id, to_role)
        except Exception as exc:  # noqa: BLE001 - the actor died (recovery relaunches it) or is wedged
            record.outcome, record.reason = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            self.directory.release(leaving.instance_id)
        record.seconds = time.monotonic() - started
        self.metrics.observe_switch(record.outcome, record.seconds)
        log = logger.info if record.outcome == "done" else logger.warning
        log("switch of %s from %s to %s: %s after %.1f s %s", leaving.instance_id, from_role, to_role,
            record.outcome, record.seconds, record.reason)  # fmt: skip
        return record

    # ---- one scale step -----------------------------------------------------------------------
    async def scale(self, role: str, delta: int) -> SwitchRecord | None:
        """Adds an instance to `role`'s pool (delta 1) or removes its least busy (delta -1; never
        the last of a pool), through the scaler; the loop's split follows."""
        if self.scaler is None or delta not in (1, -1):
            return None
        pool = self.directory.healthy(role)
        if delta < 0 and len(pool) < 2:
            return None
        record = SwitchRecord(time.time(), "", "" if delta > 0 else role, role if delta > 0 else "",
                              "add" if delta > 0 else "remove")  # fmt: skip
        self.switches.append(record)
        started = time.monotonic()
        try:
            record.outcome, record.reason = await (self._add(record, role) if delta > 0 else self._remove(record, pool))
        except Exception as exc:  # noqa: BLE001 - Ray could not place or start it, or the actor died
            record.outcome, record.reason = "failed", f"{type(exc).__name__}: {exc}"
        record.seconds = time.monotonic() - started
        if record.outcome == "done":
            self.resize(self.total + delta)
        self.metrics.observe_scale("up" if delta > 0 else "down", record.outcome)
        log = logger.info if record.outcome == "done" else logger.warning
        log("%s of %s instance %s: %s after %.1f s %s", record.kind, role, record.instance_id or "(none)",
            record.outcome, record.seconds, record.reason)  # fmt: skip
        return record

    async def _add(self, record: SwitchRecord, role: str) -> tuple[str, str]:
        launched = await asyncio.to_thread(self.scaler.add, role)
        record.instance_id = launched.instance_id
        await self._until_registered(record.instance_id, role)
        return "done", ""

    async def _remove(self, record: SwitchRecord, pool: list[Instance]) -> tuple[str, str]:
        """Drained first, as a switch drains (its decodes move away with their KV, its prompts
        finish); stopped only once it holds nothing, else back in service."""
        leaving = min(pool, key=lambda i: (i.view.load.num_running + i.view.load.num_waiting, i.instance_id))
        record.instance_id = leaving.instance_id
        self.directory.hold_out(leaving.instance_id)
        try:
            await self._call(leaving.actor.drain.remote())
            if not await self._until_idle(leaving):
                await self._call(leaving.actor.resume_service.remote())
                return "failed", f"still held requests after {self.config.replan_switch_timeout_s:.0f} s"
            await asyncio.to_thread(self.scaler.remove, leaving.instance_id)
            await self._until_gone(leaving.instance_id)
            return "done", ""
        finally:
            self.directory.release(leaving.instance_id)

    async def _until_idle(self, instance: Instance) -> bool:
        deadline = time.monotonic() + self.config.replan_switch_timeout_s
        while time.monotonic() < deadline:
            load = await self._call(instance.actor.load.remote())
            if load.num_running + load.num_waiting + load.num_waiting_for_kv == 0:
                return True
            await asyncio.sleep(IDLE_POLL_S)
        return False

    async def _until_gone(self, instance_id: str) -> None:
        """For the directory to drop it (its registration ended with it), so it is not counted."""
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while time.monotonic() < deadline and self.directory.get(instance_id) is not None:
            await asyncio.sleep(IDLE_POLL_S)

    async def _switch_when_idle(self, instance: Instance, to_role: str, not_before: float = 0.0) -> tuple[str, str]:
        """Asks the instance to switch, from `not_before` (time.monotonic()) on, until it holds
        nothing and does (its engine thread refuses while it holds requests)."""
        deadline = time.monotonic() + self.config.replan_switch_timeout_s
        await asyncio.sleep(max(0.0, not_before - time.monotonic()))
        while True:
            try:
                await self._call(instance.actor.switch_role.remote(to_role))
                return "done", ""
            except Exception as exc:  # noqa: BLE001 - Ray wraps the worker's ValueError
                if "drain it first" not in str(exc):
                    return "failed", f"{type(exc).__name__}: {exc}"
                if time.monotonic() > deadline:
                    return "failed", f"still held requests after {self.config.replan_switch_timeout_s:.0f} s"
            await asyncio.sleep(IDLE_POLL_S)

    async def _call(self, call):
        """A Ray call on an instance, bounded: a wedged instance fails the switch, not the loop."""
        try:
            return await asyncio.wait_for(call, self.config.control_call_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer within {self.config.control_call_timeout_s:.0f} s") from None

    async def _until_registered(self, instance_id: str, role: str) -> None:
        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        while time.monotonic() < deadline:
            found = self.directory.get(instance_id)
            if found is not None and found.role == role:
                return
            await asyncio.sleep(IDLE_POLL_S)


def _size(split: Split) -> int:
    return split.prefill + split.decode
