"""The re-planning loop's scale steps (issue 53, item 3) on stand-ins for the directory, the
instances' actors and the launcher: an instance added once the step is confirmed and the cluster
has room, one removed only after it drained and held nothing, never the last of a pool, and the
step checked as a switch is. No Ray: the pricing is given, the actors' calls are awaitables."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from disagg.config import ServingConfig
from disagg.metrics import ServingMetrics
from disagg.planner.live_pricing import Price
from disagg.planner.replanner import Split, TrafficWindow
from disagg.router import replanning
from disagg.router.replanning import ReplanLoop


@dataclass
class Load:
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_kv: int = 0


class Actor:
    """`load` reports `busy` requests for that many calls, then none."""

    def __init__(self, log: list, name: str, busy: int = 0):
        self.log, self.name, self.busy = log, name, busy

    def __getattr__(self, method: str):
        actor = self

        class Method:
            @staticmethod
            async def remote(*args):
                actor.log.append((actor.name, method))
                if method == "load":
                    actor.busy = max(0, actor.busy - 1)
                    return Load(num_running=1 if actor.busy else 0)

        return Method


@dataclass
class Inst:
    instance_id: str
    role: str
    actor: Actor
    view: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(load=Load()))


class Directory:
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


class Scaler:
    """The launcher's stand-in: an added instance registers at once, a removed one is gone."""

    def __init__(self, directory: Directory, log: list, room: bool = True):
        self.directory, self.log, self.room = directory, log, room

    def room_for(self, role):
        return self.room

    def add(self, role):
        instance_id = f"{role}-{len(self.directory.instances)}"
        self.directory.instances.append(Inst(instance_id, role, Actor(self.log, instance_id)))
        self.log.append(("launcher", "add", role))
        return SimpleNamespace(instance_id=instance_id)

    def remove(self, instance_id):
        self.directory.instances.remove(self.directory.get(instance_id))
        self.log.append(("launcher", "remove", instance_id))


def setup(decode: int = 1, busy: int = 0, room: bool = True, **settings):
    log: list = []
    instances = [Inst("p0", "prefill", Actor(log, "p0"))]
    instances += [Inst(f"d{i}", "decode", Actor(log, f"d{i}", busy)) for i in range(decode)]
    directory = Directory(instances)
    config = ServingConfig.from_dict({"decode": {"num_instances": decode}, "replan_hold_s": 0.0, **settings})
    scaler = Scaler(directory, log, room)
    loop = ReplanLoop(config, directory, lambda: object(), ServingMetrics(), scaler=scaler)
    now = time.monotonic()
    for i in range(10):  # a window with enough requests to price
        loop.arrived(now - i * 0.1, 30, 30)
    return loop, directory, log


def pricing(loop: ReplanLoop, attainments: dict[Split, float]) -> list:
    """Each round's splits asked for are kept; their prices are `attainments`."""
    asked = []

    async def price(live, requests, splits):
        asked.append(list(splits))
        return {s: Price(attainments[s], attainments[s] / 100) for s in splits if s in attainments}

    loop._live = lambda requests: None
    loop._price = price
    return asked


def scale_counts(loop: ReplanLoop) -> dict:
    samples = loop.metrics.replan_scale.collect()[0].samples
    return {(s.labels["direction"], s.labels["outcome"]): s.value for s in samples if s.name.endswith("_total")}


def test_the_default_one_plus_one_adds_a_decode_instance_once_confirmed(monkeypatch):
    monkeypatch.setattr(replanning, "REGISTER_TIMEOUT_S", 0.0)
    loop, directory, log = setup()
    asked = pricing(loop, {Split(1, 1): 40.0, Split(1, 2): 95.0, Split(2, 1): 45.0})
    first = asyncio.run(loop.step())
    assert first.switch is None and ("launcher", "add", "decode") not in log  # seen once
    assert set(asked[0]) == {Split(1, 1), Split(1, 2), Split(2, 1)}  # no switch of 1 + 1: only scale steps
    entry = asyncio.run(loop.step())
    assert entry.switch.kind == "add" and entry.switch.outcome == "done" and entry.switch.to_role == "decode"
    assert entry.decision.best == Split(1, 2) and "add a decode instance" in entry.decision.reason
    assert loop.current_split() == Split(1, 2) and loop.total == 3
    assert entry.check is not None and entry.check.after == Split(1, 2)  # checked as a switch is
    assert scale_counts(loop) == {("up", "done"): 1.0}


def test_no_add_without_room():
    loop, _, log = setup(room=False)
    pricing(loop, {Split(1, 1): 40.0, Split(1, 2): 95.0, Split(2, 1): 45.0})
    for _ in range(3):
        assert asyncio.run(loop.step()) is None  # 1 + 1 with no room: nothing to choose, nothing priced
    assert not [c for c in log if c[0] == "launcher"] and not loop.log


def test_a_removal_drains_first_and_stops_the_instance_once_it_holds_nothing(monkeypatch):
    monkeypatch.setattr(replanning, "REGISTER_TIMEOUT_S", 0.0)
    loop, directory, log = setup(decode=2, busy=3, room=False, replan_min_gain=100.0)  # no switch is worth it
    pricing(loop, {Split(1, 2): 100.0, Split(1, 1): 99.5, Split(2, 1): 50.0})
    asyncio.run(loop.step())
    entry = asyncio.run(loop.step())
    assert entry.switch.kind == "remove" and entry.switch.outcome == "done"
    leaving = entry.switch.instance_id
    calls = [c[1] for c in log if c[0] in (leaving, "launcher")]
    assert calls[0] == "drain" and calls.count("load") == 3 and calls[-1] == "remove"
    assert loop.current_split() == Split(1, 1) and not directory.held
    assert asyncio.run(loop.scale("decode", -1)) is None  # never the last of a pool


def test_a_removal_that_does_not_drain_in_time_leaves_the_instance_in_service():
    loop, directory, log = setup(decode=2, busy=10**6, replan_switch_timeout_s=0.3)
    record = asyncio.run(loop.scale("decode", -1))
    assert record.outcome == "failed" and "still held requests" in record.reason
    assert log[-1][1] == "resume_service" and len(directory.healthy("decode")) == 2
    assert loop.total == 3 and scale_counts(loop) == {("down", "failed"): 1.0}


def test_an_added_instance_that_measured_worse_than_staying_is_removed_again(monkeypatch):
    monkeypatch.setattr(replanning, "REGISTER_TIMEOUT_S", 0.0)
    loop, directory, log = setup()
    attainments = {Split(1, 1): 40.0, Split(1, 2): 95.0, Split(2, 1): 45.0}
    pricing(loop, attainments)
    asyncio.run(loop.step())
    added = asyncio.run(loop.step())
    assert added.switch.kind == "add" and loop.current_split() == Split(1, 2)
    # The window after it: 10% met, where the same traffic priced staying 40 points above the new split.
    attainments.update({Split(1, 1): 90.0, Split(1, 2): 50.0})
    monkeypatch.setattr(loop.metrics, "slo_outcomes", lambda since, until: (1, 10))
    for _ in range(10):
        loop.arrived(time.monotonic(), 30, 30)
    undo = asyncio.run(loop.step())
    assert added.check.outcome == "undone" and undo.decision.reason.startswith("undo")
    assert undo.switch.kind == "remove" and undo.switch.outcome == "done"
    assert loop.current_split() == Split(1, 1) and ("launcher", "remove", undo.switch.instance_id) in log
    assert scale_counts(loop) == {("up", "done"): 1.0, ("down", "done"): 1.0}


def test_traffic_that_stops_still_sheds_an_instance(monkeypatch):
    """A window too light to choose a split by (fewer requests than MIN_WINDOW_REQUESTS, or none)
    is still priced for the removals alone: a pool grown under load shrinks once the load is gone,
    and no add or switch is priced on so little."""
    monkeypatch.setattr(replanning, "REGISTER_TIMEOUT_S", 0.0)
    loop, directory, log = setup(decode=2, room=True)
    loop.window = TrafficWindow(loop.config.replan_window_s)
    loop.arrived(time.monotonic(), 30, 30)  # one request in the window
    asked = pricing(loop, {Split(1, 2): 100.0, Split(1, 1): 100.0, Split(2, 2): 100.0, Split(1, 3): 100.0})
    asyncio.run(loop.step())
    entry = asyncio.run(loop.step())
    assert asked[0] == [Split(1, 2), Split(1, 1)]  # the split now and one decode fewer (never the last prefill)
    assert entry.switch.kind == "remove" and entry.switch.outcome == "done" and loop.current_split() == Split(1, 1)
