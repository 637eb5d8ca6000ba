"""The server's re-planning loop (disagg.router.replanning) on stand-ins for the directory and
the instances' actors: what a decision sets in motion (which instance leaves, in what order it
is drained, switched and resumed), a switch refused until its deadline, and the split it
watches. No Ray: the actors' methods are awaitables recording their calls."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


from disagg.config import ServingConfig
from disagg.errors import RegistryUnavailable
from disagg.metrics import ServingMetrics
from disagg.planner.decision_check import Check
from disagg.planner.live_pricing import Price
from disagg.slo import SLO
from disagg.planner.replanner import Decision, Split
from disagg.router import replanning
from disagg.router.replanning import ReplanLoop


class Actor:
    """Each method's `.remote(*args)` is awaitable and logs the call; switch_role refuses
    (as a busy worker does) `refusals` times, or for good with `refusals` < 0."""

    def __init__(self, log: list, name: str, refusals: int = 0, wedged: bool = False):
        self.log, self.name, self.refusals, self.wedged = log, name, refusals, wedged

    def __getattr__(self, method: str):
        actor = self

        class Method:
            @staticmethod
            async def remote(*args):
                actor.log.append((actor.name, method, *args))
                if actor.wedged:  # a call Ray never answers
                    await asyncio.Event().wait()
                if method == "switch_role" and actor.refusals != 0:
                    actor.refusals -= 1
                    raise ValueError("switch: the instance still holds requests; drain it first")

        return Method


@dataclass
class Load:
    num_running: int = 0
    num_waiting: int = 0


@dataclass
class View:
    load: Load = field(default_factory=Load)


@dataclass
class Inst:
    instance_id: str
    role: str
    actor: Actor
    view: View = field(default_factory=View)


class Directory:
    refresh_interval_s = 0.0  # a frontend's reads of the registry (the switch waits one out)

    def __init__(self, instances: list[Inst]):
        self.instances, self.held = instances, set()

    def healthy(self, role):
        return [i for i in self.instances if i.role == role and i.instance_id not in self.held]

    def get(self, instance_id):
        return next((i for i in self.instances if i.instance_id == instance_id), None)

    def hold_out(self, instance_id):
        self.held.add(instance_id)

    def release(self, instance_id):
        self.held.discard(instance_id)


def setup(refusals: int = 0, **settings):
    log: list = []
    instances = [
        Inst("p0", "prefill", Actor(log, "p0")),
        Inst("d0", "decode", Actor(log, "d0", refusals), View(Load(num_running=1))),
        Inst("d1", "decode", Actor(log, "d1", refusals), View(Load(num_running=5))),
    ]
    directory = Directory(instances)
    config = ServingConfig.from_dict({"prefill": {"num_instances": 1}, "decode": {"num_instances": 2}, **settings})
    switched = []

    def on_switched(instance_id, role):
        directory.get(instance_id).role = role  # as its next heartbeat would show it
        switched.append((instance_id, role))

    loop = ReplanLoop(config, directory, lambda: object(), ServingMetrics(), on_switched)
    return loop, directory, log, switched


def idle(directory: Directory) -> None:
    for instance in directory.instances:
        instance.view = View()


def deciding(loop: ReplanLoop, switch_to: Split | None) -> None:
    def decide(now, current, window, predicted=None):
        return Decision(now, current, switch_to or current, {}, switch_to, "stand-in")

    loop.replanner.decide = decide


def test_a_switch_drains_the_least_busy_instance_then_switches_and_resumes_it(monkeypatch):
    loop, directory, log, switched = setup()
    monkeypatch.setattr(replanning, "REGISTER_TIMEOUT_S", 0.0)  # the stand-in directory changes role only on_switched
    assert loop.current_split() == Split(1, 2)
    deciding(loop, Split(2, 1))
    entry = asyncio.run(loop.step())
    assert entry.switch.outcome == "done" and entry.switch.instance_id == "d0"  # d0 runs 1 request, d1 5
    assert [call[1:] for call in log] == [("drain",), ("switch_role", "prefill"), ("resume_service",)]
    assert switched == [("d0", "prefill")] and not directory.held
    assert loop.current_split() == Split(2, 1)
    assert list(loop.log) == [entry]


class TimedLog(list):
    """Each call with when it was made (time.monotonic())."""

    def append(self, call) -> None:
        super().append((time.monotonic(), *call))


def test_a_switch_waits_until_every_frontend_can_have_seen_the_drain(monkeypatch):
    """A frontend learns of the drain at its next read of the registry: a prompt it placed before
    then must still find the instance in its old role, not be refused by the new one."""
    loop, directory, _, switched = setup()
    monkeypatch.setattr(replanning, "REGISTER_TIMEOUT_S", 0.0)
    monkeypatch.setattr(replanning, "DRAIN_SEEN_MARGIN_S", 0.1)
    directory.refresh_interval_s = 0.3
    calls = TimedLog()
    for instance in directory.instances:
        instance.actor.log = calls
    deciding(loop, Split(2, 1))
    assert asyncio.run(loop.step()).switch.outcome == "done" and switched == [("d0", "prefill")]
    when = {method: at for at, _, method, *_ in calls}
    assert when["switch_role"] - when["drain"] >= 0.4 - 0.01


def test_a_switch_refused_until_the_deadline_leaves_the_instance_in_its_role_and_in_service():
    loop, directory, log, switched = setup(refusals=-1, replan_switch_timeout_s=0.3)
    deciding(loop, Split(2, 1))
    entry = asyncio.run(loop.step())
    assert entry.switch.outcome == "failed" and "still held requests" in entry.switch.reason
    assert log[-1][1:] == ("resume_service",) and switched == [] and not directory.held
    assert loop.current_split() == Split(1, 2)


def test_a_busy_instance_is_switched_once_it_has_drained(monkeypatch):
    loop, _, log, switched = setup(refusals=2)
    monkeypatch.setattr(replanning, "REGISTER_TIMEOUT_S", 0.0)  # the stand-in directory changes role only on_switched
    deciding(loop, Split(2, 1))
    entry = asyncio.run(loop.step())
    assert entry.switch.outcome == "done"
    assert [c[1] for c in log].count("switch_role") == 3 and switched == [("d0", "prefill")]


def test_no_decision_while_an_instance_is_away_or_nothing_to_price_with():
    loop, directory, log, _ = setup()
    deciding(loop, Split(2, 1))
    directory.hold_out("d1")  # e.g. failed, or draining
    assert loop.current_split() is None and asyncio.run(loop.step()) is None
    directory.release("d1")
    loop.profile = lambda: None  # no fitted model and no profile yet
    assert asyncio.run(loop.step()) is None and log == []


def test_the_last_instance_of_a_pool_is_never_taken():
    loop, _, log, _ = setup()
    assert asyncio.run(loop.switch("prefill", "decode")) is None and log == []


def test_a_decision_without_a_switch_is_logged_and_moves_nothing():
    loop, _, log, _ = setup()
    deciding(loop, None)
    entry = asyncio.run(loop.step())
    assert entry.switch is None and log == [] and list(loop.log) == [entry]


def test_each_round_plans_on_the_other_frontends_arrivals_too():
    loop, directory, _, _ = setup()
    idle(directory)  # the round has only these arrivals: too few to price
    now = time.monotonic()
    own = SLO(500.0, 40.0)
    shared = [[(now - 2.0, 100, 50, None, 0), (now - 1.0, 200, 60, own, -1)], []]
    loop.shared_arrivals = lambda: shared.pop(0)
    loop.arrived(now - 1.5, 300, 70)  # frontend 0's own
    seen = []

    def decide(at, current, window, predicted=None):
        seen.append([(r.prompt_len, r.output_len, r.slo, r.priority) for r in window.requests(at)])
        return Decision(at, current, current, {}, None, "stand-in")

    loop.replanner.decide = decide
    asyncio.run(loop.step())
    asyncio.run(loop.step())
    expected = [(100, 50, None, 0), (300, 70, None, 0), (200, 60, own, -1)]  # each priced by its own SLO
    assert seen == [expected] * 2, "in arrival order, each taken once"


def test_a_round_without_the_shared_arrivals_plans_on_its_own():
    loop, directory, _, _ = setup()
    idle(directory)  # the round has only these arrivals: too few to price

    def unavailable():
        raise RegistryUnavailable("registry take_arrivals failed: Redis away")

    loop.shared_arrivals = unavailable
    loop.arrived(time.monotonic(), 300, 70)
    seen = []

    def decide(at, current, window, predicted=None):
        seen.append(len(window.requests(at)))
        return Decision(at, current, current, {}, None, "stand-in")

    loop.replanner.decide = decide
    assert asyncio.run(loop.step()).switch is None and seen == [1]


# ---- every switch checked (issue 53) ------------------------------------------------------------------
class Pricer:
    """Each split's price, whatever it is asked (the pricing process's stand-in)."""

    def __init__(self, prices: dict):
        self.prices, self.calls = prices, 0

    async def run(self, fn, *args):
        self.calls += 1
        return dict(self.prices)

    def close(self):
        pass


def priced_loop(prices: dict, monkeypatch):
    loop, directory, log, switched = setup()
    monkeypatch.setattr(replanning, "REGISTER_TIMEOUT_S", 0.0)
    loop.pricer = Pricer(prices)
    loop._live = lambda requests: None  # the stand-in instances have no fitted models
    now = time.monotonic()
    for k in range(10):
        loop.arrived(now - 1.0 + k * 0.05, 100, 20)
    return loop, directory, log, switched


def test_a_switch_opens_a_check_with_what_it_was_predicted_to_give(monkeypatch):
    prices = {Split(1, 2): Price(40.0, 2.0), Split(2, 1): Price(90.0, 4.5)}
    loop, _, _, switched = priced_loop(prices, monkeypatch)
    deciding(loop, Split(2, 1))
    entry = asyncio.run(loop.step())
    assert switched == [("d0", "prefill")] and loop.pricer.calls == 1
    assert entry.check is loop.checker.pending and entry.check.predicted == Price(90.0, 4.5)
    assert entry.check.predicted_stay == Price(40.0, 2.0) and entry.decision.predicted_goodput[Split(2, 1)] == 4.5
    later = asyncio.run(loop.step())  # within the hold: it decides on, and the check stays open
    assert later.check is None and later.switch is None and loop.checker.pending is entry.check


def test_a_switch_that_measured_worse_than_staying_is_undone_and_not_chosen_again(monkeypatch):
    # On the window after the switch, priced again: 1P:2D (the new split) 80, 2P:1D 90; all 10
    # judged missed: staying is estimated at 0 + (90 - 80) = 10 > 0 + margin 5.
    prices = {Split(1, 2): Price(80.0, 4.0), Split(2, 1): Price(90.0, 4.5)}
    loop, _, log, switched = priced_loop(prices, monkeypatch)
    now = time.monotonic()
    decided = now - loop.config.replan_hold_s - 1.0  # the hold after it is over: the check is due
    opened = decided + 1.0
    check = Check(decided, Split(2, 1), Split(1, 2), Price(85.0, 4.2), Price(60.0, 3.0), opens_at=opened)
    loop.checker.open(check)
    for k in range(10):
        loop.arrived(opened + 1.0 + k, 100, 20)
        loop.metrics.observe_slo("standard", False, now=opened + 2.0 + k)
    entry = asyncio.run(loop.step())
    assert check.outcome == "undone" and check.measured.attainment == 0.0 and check.stay.attainment == 10.0
    assert entry.check is check and entry.decision.reason.startswith("undo")
    assert switched == [("d0", "prefill")] and entry.switch.outcome == "done"
    assert loop.checker.residuals[Split(1, 2)] == -80.0, "measured 0 where 80 was priced"
    assert loop.replanner._vetoed[Split(1, 2)] > now
    assert loop.metrics.replan_measured_goodput._value.get() == 0.0
    assert loop.metrics.replan_predicted_goodput._value.get() == 4.2


def test_in_the_controller_a_check_measures_the_frontends_shared_verdicts(monkeypatch):
    """The loop in the controller serves nothing: its own metrics judge no request, so a due check
    measures what the frontends shared (here 10 misses after the switch), and is undone on it."""
    prices = {Split(1, 2): Price(80.0, 4.0), Split(2, 1): Price(90.0, 4.5)}
    loop, _, _, switched = priced_loop(prices, monkeypatch)
    now = time.monotonic()
    opened = now - loop.config.replan_hold_s
    check = Check(opened - 1.0, Split(2, 1), Split(1, 2), Price(85.0, 4.2), Price(60.0, 3.0), opens_at=opened)
    loop.checker.open(check)
    shared = [[(opened + 2.0 + k, False) for k in range(10)]]
    loop.shared_verdicts = lambda: shared.pop() if shared else []
    for k in range(10):
        loop.arrived(opened + 1.0 + k, 100, 20)
    entry = asyncio.run(loop.step())
    assert check.outcome == "undone" and check.measured.attainment == 0.0, check
    assert entry.check is check and switched == [("d0", "prefill")]


def test_a_wedged_instance_fails_its_switch_and_the_replanner_goes_on(monkeypatch):
    monkeypatch.setattr(replanning, "REGISTER_TIMEOUT_S", 0.0)
    loop, directory, log, switched = setup(control_call_timeout_s=0.2)
    directory.get("d0").actor.wedged = True
    deciding(loop, Split(2, 1))

    async def two_rounds():
        first = await asyncio.wait_for(loop.step(), 5.0)
        directory.get("d0").actor.wedged = False
        return first, await asyncio.wait_for(loop.step(), 5.0)

    started = time.monotonic()
    first, second = asyncio.run(two_rounds())
    assert first.switch.outcome == "failed" and "no answer within" in first.switch.reason
    assert time.monotonic() - started < 3.0, "one call's timeout, not a hang"
    assert not directory.held, "the wedged instance is released, not held out for good"
    assert second.switch.outcome == "done" and switched == [("d0", "prefill")]
