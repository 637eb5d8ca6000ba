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
puts the instance back in service in its old role. The step models the simulator prices with
are the instances' own, fitted online, over the configured profile (or without one, once both
roles are calibrated); until then the loop only watches. Decisions, their predicted gains and
what followed are kept for `disagg status`, counted in the metrics and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from disagg.config import ServingConfig
from disagg.errors import RegistryUnavailable
from disagg.metrics import ServingMetrics
from disagg.placement.latency_model import StepModel
from disagg.placement.profile import Profile, load_profile
from disagg.planner.replanner import Decision, Replanner, Split, TrafficWindow, split_simulator
from disagg.router.directory import Instance, InstanceDirectory

if TYPE_CHECKING:  # (torch, behind it, would slow every start of the controller that runs this)
    from disagg.engine.model_card import ModelCard

logger = logging.getLogger(__name__)
IDLE_POLL_S = 0.1
REGISTER_TIMEOUT_S = 10.0  # for the directory to find the instance in its new pool
ROLES = ("prefill", "decode")


@dataclass
class SwitchRecord:
    """One instance moved from a pool to the other (or not, `outcome` "failed")."""

    at: float  # time.time() of the decision
    instance_id: str
    from_role: str
    to_role: str
    outcome: str = "running"  # running | done | failed
    seconds: float = 0.0  # from the decision to serving in the new role (or to giving up)
    reason: str = ""


@dataclass
class LoggedDecision:
    at: float  # time.time()
    decision: Decision
    switch: SwitchRecord | None = None


@dataclass
class ReplanView:
    """The controller's latest re-planning decisions as a frontend last fetched them (for
    `disagg status`: ClusterStatus shows `log`)."""

    log: list[LoggedDecision] = field(default_factory=list)


def replans(config: ServingConfig) -> bool:
    """Re-planning runs where instances may switch (ServingConfig.switchable) and there is a
    split to choose (three instances or more)."""
    return config.switchable() and config.prefill.num_instances + config.decode.num_instances >= 3


def replan_loop_for(
    config: ServingConfig, directory: InstanceDirectory, card: ModelCard, metrics: ServingMetrics,
    on_switched: Callable[[str, str], None], shared_arrivals: Callable[[], list[tuple[float, int, int]]],
) -> ReplanLoop | None:  # fmt: skip
    """The closed loop the controller runs, fed every frontend's arrivals (`shared_arrivals`);
    None where it would not run (replans)."""
    if not replans(config):
        return None
    base = load_profile(config.profile) if config.profile else None
    dtype_bytes = 4 if config.engine.dtype == "float32" else 2
    kv_bytes = card.config.kv_bytes_per_token * dtype_bytes
    layers = card.config.num_hidden_layers

    def profile():
        return live_profile(base, directory, config.engine.model, kv_bytes, layers)

    return ReplanLoop(config, directory, profile, metrics, on_switched, shared_arrivals=shared_arrivals)


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


class ReplanLoop:
    def __init__(
        self,
        config: ServingConfig,
        directory: InstanceDirectory,
        profile: Callable[[], Profile | None],
        metrics: ServingMetrics,
        on_switched: Callable[[str, str], None] = lambda instance_id, role: None,
        shared_arrivals: Callable[[], list[tuple[float, int, int]]] | None = None,
    ):
        """`profile()`: what the simulator prices with now (live_profile); `on_switched(id,
        role)`: an instance serves in its new role (the launcher's records follow);
        `shared_arrivals()`: the other frontends' arrivals since the last call, as `arrived`
        takes them (disagg.router.shared_arrivals), taken before each round."""
        self.config, self.directory, self.profile, self.metrics = config, directory, profile, metrics
        self.on_switched = on_switched
        self.shared_arrivals = shared_arrivals
        self.window = TrafficWindow(config.replan_window_s)
        self.total = config.prefill.num_instances + config.decode.num_instances
        self.replanner = Replanner(
            self._simulate, self.total, config.slo,
            min_gain=config.replan_min_gain, hold_s=config.replan_hold_s,
        )  # fmt: skip
        self.log: deque[LoggedDecision] = deque(maxlen=64)  # the latest decisions, for `disagg status`
        self.switches: list[SwitchRecord] = []
        self._profile: Profile | None = None

    def arrived(self, at: float, prompt_tokens: int, max_tokens: int) -> None:
        """A request arrived (the orchestrator's ArrivalListener)."""
        self.window.add(at, prompt_tokens, max_tokens)

    def current_split(self) -> Split | None:
        """The split in placement now; None while an instance is away (failed, draining)."""
        split = Split(len(self.directory.healthy("prefill")), len(self.directory.healthy("decode")))
        return split if split.prefill + split.decode == self.total else None

    async def run(self) -> None:
        """Rounds every replan_interval_s; a round that raises ends it (disagg.supervision restarts
        it, counted)."""
        while True:
            await asyncio.sleep(self.config.replan_interval_s)
            await self.step()

    async def step(self) -> LoggedDecision | None:
        """One round: decide, and switch if the decision says so (returns what was logged)."""
        await self._take_shared_arrivals()
        current = self.current_split()
        self._profile = self.profile()
        if current is None or self._profile is None:
            return None
        # The simulation is pure Python and takes a while: off the event loop's thread.
        decision = await asyncio.to_thread(self.replanner.decide, time.monotonic(), current, self.window)
        self.metrics.observe_replan(decision.switch_to is not None, decision.gain)
        entry = LoggedDecision(time.time(), decision)
        self.log.append(entry)
        if decision.switch_to is None:
            logger.debug("re-plan at %s: %s", current, decision.reason)
            return entry
        logger.info("re-plan: switching toward %s (%s)", decision.best, decision.reason)
        from_role = "prefill" if decision.switch_to.prefill < current.prefill else "decode"
        entry.switch = await self.switch(from_role, "decode" if from_role == "prefill" else "prefill")
        return entry

    async def _take_shared_arrivals(self) -> None:
        if self.shared_arrivals is None:
            return
        try:
            arrivals = await asyncio.to_thread(self.shared_arrivals)
        except RegistryUnavailable as exc:  # this round plans on what it took before
            logger.warning("re-plan without the other frontends' arrivals: %s", exc)
            return
        for at, prompt_tokens, max_tokens in arrivals:
            self.window.add(at, prompt_tokens, max_tokens)

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
            record.outcome, record.reason = await self._switch_when_idle(leaving, to_role)
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

    async def _switch_when_idle(self, instance: Instance, to_role: str) -> tuple[str, str]:
        """Asks the instance to switch until it holds nothing and does (its engine thread
        refuses while it holds requests)."""
        deadline = time.monotonic() + self.config.replan_switch_timeout_s
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
