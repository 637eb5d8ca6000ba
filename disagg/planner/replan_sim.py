"""What re-planning gains, before anyone deploys it (issue 36, item 4): the simulator serves a
workload while the re-planner decides every `interval_s` from the requests it has seen arrive
(each with the output it asks for: what a router knows of it then), and its switches play out as
the server plays them.

A switch takes one instance out of placement in its old pool at once; once it holds nothing
(its prompts done and their KV sent, its decodes finished) and `switch_s` more have passed, it
serves in the other pool with an empty engine. Two simplifications, both on the side of caution:
the decodes of a leaving decode instance finish where they are (the server moves them away with
their KV, which is faster), and no two switches overlap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.config import ServingConfig
from disagg.placement.profile import Profile
from disagg.planner.deployment import Deployment, with_split
from disagg.planner.replanner import Decision, Replanner, Split, TrafficWindow, reachable_splits, split_simulator
from disagg.planner.simulator import SimInstance, SimRecord, Simulator, num_met
from disagg.planner.workload import SimRequest
from disagg.slo import SLO

SWITCH_S = 2.0  # an idle instance to serving in its new role (bench_replan's `switch p50 s` measures it)
IDLE_POLL_S = 0.05


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


def simulate_replanning(
    config: ServingConfig,
    profiles: dict[str, Profile],
    requests: list[SimRequest],
    *,
    interval_s: float = 5.0,
    window_s: float = 30.0,
    switch_s: float = SWITCH_S,
    **replanner_args,
) -> ReplanRun:
    """Serve `requests` on `config` (disaggregated) with the re-planner switching instances."""
    window = TrafficWindow(window_s)
    sim = Deployment(config, profiles).simulator(
        on_arrive=lambda r: window.add(r.arrival_s, r.prompt_len, r.output_len)
    )
    total = config.prefill.num_instances + config.decode.num_instances
    planner = Replanner(split_simulator(config, profiles), total, config.slo, **replanner_args)
    driver = _Driver(sim, planner, window, switch_s)
    end = max((r.arrival_s for r in requests), default=0.0)
    t = interval_s
    while t < end:
        sim.at(t, driver.decide)
        t += interval_s
    records = sim.run(requests)
    return ReplanRun(records, planner.history, driver.switches)


class _Driver:
    def __init__(self, sim: Simulator, planner: Replanner, window: TrafficWindow, switch_s: float):
        self.sim, self.planner, self.window, self.switch_s = sim, planner, window, switch_s
        self.switches: list[Switch] = []
        self.pools = {pool.role: pool for pool in sim.pools}

    def decide(self, now: float) -> None:
        if self.switches and self.switches[-1].done_s is None:
            return  # one switch at a time
        current = Split(len(self.sim.instances["prefill"]), len(self.sim.instances["decode"]))
        decision = self.planner.decide(now, current, self.window)
        if decision.switch_to is None:
            return
        from_role, to_role = (
            ("decode", "prefill") if decision.switch_to.prefill > current.prefill else ("prefill", "decode")
        )
        leaving = min(self.sim.instances[from_role], key=lambda i: (i.num_requests, i.instance_id))
        self.sim.instances[from_role].remove(leaving)  # out of placement at once
        switch = Switch(now, leaving.instance_id, to_role)
        self.switches.append(switch)
        self.sim.at(now, self._when_idle, leaving, switch)

    def _when_idle(self, now: float, instance: SimInstance, switch: Switch) -> None:
        if not instance.is_idle:
            self.sim.at(now + IDLE_POLL_S, self._when_idle, instance, switch)
            return
        self.sim.at(now + self.switch_s, self._join, instance, switch)

    def _join(self, now: float, instance: SimInstance, switch: Switch) -> None:
        instance.become(self.pools[switch.to_role])
        self.sim.instances[switch.to_role].append(instance)
        switch.done_s = now


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
