"""What re-planning gains, before anyone deploys it (issue 36, item 4): the simulator serves a
workload while the re-planner decides every `interval_s` from the requests it has seen arrive
(each with the output it asks for: what a router knows of it then), and its switches play out as
the server plays them.

The policy is the server's (disagg.router.replanning, issue 53): each round prices every split
from the simulated system's live state (its instances' queues, decodes and models:
`live_state_of`), corrected by the residuals of earlier misses; each switch is checked one window
after it is done against staying, on the requests judged in that window, and undone if worse.

A switch takes one instance out of placement in its old pool at once; once it holds nothing
(its prompts done and their KV sent, its decodes finished) and `switch_s` more have passed, it
serves in the other pool with an empty engine. Two simplifications, both on the side of caution:
the decodes of a leaving decode instance finish where they are (the server moves them away with
their KV, which is faster), and no two switches overlap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from disagg.config import ServingConfig
from disagg.placement.profile import Profile
from disagg.planner.decision_check import Check, DecisionChecker
from disagg.planner.deployment import Deployment, with_split
from disagg.planner.live_pricing import SWITCH_S, Price, price_splits
from disagg.planner.live_state import LiveDecode, LiveInstance, LiveState, enough_to_price
from disagg.planner.replanner import (
    MIN_WINDOW_REQUESTS,
    Decision,
    Replanner,
    Split,
    TrafficWindow,
    reachable_splits,
    split_simulator,
)
from disagg.planner.simulator import SimInstance, SimRecord, Simulator, num_met
from disagg.planner.workload import SimRequest
from disagg.slo import SLO, met

IDLE_POLL_S = 0.05
UNDO_VETO_WINDOWS = 3  # as the server's loop (disagg.router.replanning)


@dataclass
class Switch:
    decided_s: float
    instance_id: str
    to_role: str
    done_s: float | None = None


@dataclass
class ReplanRun:
    records: list[SimRecord]
    decisions: list[Decision]
    switches: list[Switch] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)


def simulate_replanning(
    config: ServingConfig,
    profiles: dict[str, Profile],
    requests: list[SimRequest],
    *,
    interval_s: float = 5.0,
    window_s: float = 15.0,
    switch_s: float = SWITCH_S,
    **replanner_args,
) -> ReplanRun:
    """Serve `requests` on `config` (disaggregated) with the re-planner switching instances."""
    window = TrafficWindow(window_s)
    sim = Deployment(config, profiles).simulator(
        on_arrive=lambda r: window.add(r.arrival_s, r.prompt_len, r.output_len, r.slo, r.priority)
    )
    total = config.prefill.num_instances + config.decode.num_instances
    planner = Replanner(split_simulator(config, profiles), total, config.slo, **replanner_args)
    driver = _Driver(sim, planner, window, switch_s, (config, profiles))
    end = max((r.arrival_s for r in requests), default=0.0)
    t = interval_s
    while t < end:
        sim.at(t, driver.decide)
        t += interval_s
    records = sim.run(requests)
    return ReplanRun(records, planner.history, driver.switches, driver.checker.checks)


def live_state_of(sim: Simulator) -> LiveState:
    """The simulated system as the server's loop sees its own: each instance in placement with
    its model, its prompts left to compute and its decodes (context, tokens to go)."""
    return LiveState(tuple(_live(i, role) for role in ("prefill", "decode") for i in sim.instances[role]))


def _live(instance: SimInstance, role: str) -> LiveInstance:
    s = instance.scheduler
    prompts = [r.num_tokens - r.num_computed_tokens for r in (*s.running, *s.waiting) if instance._prefilling(r)]
    decodes = [LiveDecode(r.num_tokens, max(1, r.sampling_params.max_tokens - r.num_output_tokens))
               for r in s.running if not instance._prefilling(r)]  # fmt: skip
    return LiveInstance(instance.instance_id, role, instance.step_model, tuple(prompts), tuple(decodes))


class _Driver:
    def __init__(self, sim: Simulator, planner: Replanner, window: TrafficWindow, switch_s: float, deployment):
        self.sim, self.planner, self.window, self.switch_s = sim, planner, window, switch_s
        self.config, self.profiles = deployment
        self.switches: list[Switch] = []
        self.pools = {pool.role: pool for pool in sim.pools}
        self.checker = DecisionChecker()
        self._check_of: dict[int, Check] = {}  # id(switch) -> the check it opens once done

    def decide(self, now: float) -> None:
        if self.switches and self.switches[-1].done_s is None:
            return  # one switch at a time
        current = Split(len(self.sim.instances["prefill"]), len(self.sim.instances["decode"]))
        if (check := self.checker.pending) is not None and check.due(now, self.planner.hold_s):
            self._check(check, current, now)
            return
        requests, live = self.window.for_pricing(now), live_state_of(self.sim)
        held = sum(i.num_requests for i in live.instances)
        priced = self._price(live, requests) if enough_to_price(len(requests), held) else {}
        attainment = {split: price.attainment for split, price in priced.items()} or None
        decision = self.planner.decide(now, current, self.window, attainment)
        decision.predicted_goodput = {split: price.goodput for split, price in priced.items()}
        if decision.switch_to is None:
            return
        switch = self._switch(now, current, decision.switch_to)
        if decision.switch_to in priced:
            check = Check(now, current, decision.switch_to, priced[decision.switch_to], priced[current], math.inf)
            self._check_of[id(switch)] = check
            self.checker.open(check)

    def _price(self, live: LiveState | None, requests: list[SimRequest]) -> dict[Split, Price]:
        window_s = self.window.window_s
        priced = price_splits(self.config, self.profiles, live, requests, window_s, self.switch_s)
        return {split: self.checker.corrected(split, price) for split, price in priced.items()}

    def _switch(self, now: float, current: Split, target: Split) -> Switch:
        from_role, to_role = ("decode", "prefill") if target.prefill > current.prefill else ("prefill", "decode")
        leaving = min(self.sim.instances[from_role], key=lambda i: (i.num_requests, i.instance_id))
        self.sim.instances[from_role].remove(leaving)  # out of placement at once
        switch = Switch(now, leaving.instance_id, to_role)
        self.switches.append(switch)
        self.sim.at(now, self._when_idle, leaving, switch)
        return switch

    def _check(self, check: Check, current: Split, now: float) -> None:
        """As the server's loop: once the hold after the switch is over, measured against staying."""
        judged = [r for r in self.sim.records if check.opens_at <= r.arrival_s <= now and _judged_by(r, now)]
        requests = self.window.requests(now, since=check.opens_at, at_least=MIN_WINDOW_REQUESTS)
        readiness = check.readiness(now, self.planner.hold_s, len(judged), len(requests))
        if readiness == "wait":
            return
        if readiness == "unmeasured":
            check.outcome = "unmeasured"
            return
        met_count = sum(1 for r in judged if _met(r, self.config.slo))
        measured = Price(100.0 * met_count / len(judged), met_count / (now - check.opens_at))
        priced = price_splits(self.config, self.profiles, None, requests, self.window.window_s, self.switch_s)
        if self.checker.close(check, measured, priced) == "undone" and current == check.after:
            self.planner.veto(check.after, now + UNDO_VETO_WINDOWS * self.window.window_s)
            self.planner.undone(now)
            self._switch(now, current, check.before)

    def _when_idle(self, now: float, instance: SimInstance, switch: Switch) -> None:
        if not instance.is_idle:
            self.sim.at(now + IDLE_POLL_S, self._when_idle, instance, switch)
            return
        self.sim.at(now + self.switch_s, self._join, instance, switch)

    def _join(self, now: float, instance: SimInstance, switch: Switch) -> None:
        instance.become(self.pools[switch.to_role])
        self.sim.instances[switch.to_role].append(instance)
        switch.done_s = now
        if (check := self._check_of.pop(id(switch), None)) is not None:
            check.opens_at = now


def _judged_by(record: SimRecord, now: float) -> bool:
    """Whether the server would have judged it by `now`: finished by then, or failed."""
    return (record.finish_s is not None and record.finish_s <= now) or bool(record.failed)


def _met(record: SimRecord, slo: SLO) -> bool:
    return record.success and met(record.slo or slo, record.ttft_s * 1e3, record.tpot_s * 1e3)


def goodput(records: list[SimRecord], slo: SLO, duration_s: float) -> float:
    """Requests per second that met the SLO, over `duration_s`."""
    return num_met(records, slo) / duration_s if duration_s > 0 else 0.0


def replan_report(config: ServingConfig, profiles: dict[str, Profile], requests: list[SimRequest], **kwargs) -> dict:
    """Every static split's goodput on `requests`, the re-planning run's, and their ratio."""
    duration = max((r.arrival_s for r in requests), default=0.0)
    total = config.prefill.num_instances + config.decode.num_instances
    static = {
        str(split): goodput(
            Deployment(with_split(config, split.prefill, split.decode), profiles).simulator().run(requests),
            config.slo,
            duration,
        )
        for split in reachable_splits(total)
    }
    run = simulate_replanning(config, profiles, requests, **kwargs)
    replanned = goodput(run.records, config.slo, duration)
    best = max(static.values())
    return {
        "static_goodput": static,
        "best_static_goodput": best,
        "replan_goodput": replanned,
        "replan_goodput_ratio": replanned / best if best else float("inf"),
        "switches": [(s.decided_s, s.instance_id, s.to_role, s.done_s) for s in run.switches],
    }
