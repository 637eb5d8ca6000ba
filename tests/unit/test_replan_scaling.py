"""Scale, not only switch (issue 53, item 3) as pure logic: when the re-planner adds an instance
to a pool or removes one, its bounds and P:D target, its hysteresis, the live state one instance
more or fewer, and whether the cluster has room for a whole instance. No Ray."""

from __future__ import annotations

import pytest

from disagg.cluster.capacity import has_room
from disagg.config import ServingConfig
from disagg.placement.profile import load_profile
from disagg.planner.live_pricing import LAUNCH_S, Price, extended, price_splits
from disagg.planner.live_state import LiveDecode, LiveInstance, LiveState
from disagg.planner.replanner import Split
from disagg.planner.scaling import ScaleBounds, ScalePolicy, best_step, candidates
from disagg.planner.workload import SimRequest
from disagg.router.replanning import replans

ROOM = {"prefill": True, "decode": True}
BOUNDS = ScaleBounds(max_per_pool=4)


def prices(**attainments: float) -> dict[Split, Price]:
    """{"p1d2": 80.0} -> {Split(1, 2): Price(80.0, 0.8)}."""
    return {Split(int(k[1]), int(k[3])): Price(v, v / 100) for k, v in attainments.items()}


def test_adds_to_the_pool_whose_instance_predicts_most_when_it_beats_staying():
    step = best_step(Split(1, 1), prices(p1d1=50.0, p2d1=60.0, p1d2=90.0), BOUNDS, ROOM, min_gain=5.0)
    assert (step.role, step.delta, step.target, step.direction) == ("decode", 1, Split(1, 2), "up")


def test_no_add_without_room_or_below_the_gain():
    priced = prices(p1d1=50.0, p2d1=50.0, p1d2=90.0)
    assert best_step(Split(1, 1), priced, BOUNDS, {"prefill": True, "decode": False}, 5.0) is None
    assert best_step(Split(1, 1), prices(p1d1=50.0, p1d2=54.0), BOUNDS, ROOM, 5.0) is None


def test_removes_one_where_the_load_fits_in_fewer_but_not_when_overloaded():
    fits = best_step(Split(1, 3), prices(p1d3=99.0, p1d2=98.5), BOUNDS, {}, 5.0)
    assert (fits.role, fits.delta, fits.target) == ("decode", -1, Split(1, 2))
    assert best_step(Split(1, 3), prices(p1d3=99.0, p1d2=90.0), BOUNDS, {}, 5.0) is None  # loses 9 points
    assert best_step(Split(1, 3), prices(p1d3=20.0, p1d2=20.0), BOUNDS, {}, 5.0) is None  # everything misses


def test_never_below_one_instance_a_pool():
    assert candidates(Split(1, 1), BOUNDS, {}) == []
    assert best_step(Split(1, 1), prices(p1d1=100.0), BOUNDS, {}, 5.0) is None
    assert all(min(s.prefill, s.decode) >= 1 for _, _, s in candidates(Split(1, 2), BOUNDS, ROOM))


def test_the_bounds_per_pool_and_in_total():
    assert [s for _, d, s in candidates(Split(1, 4), BOUNDS, ROOM) if d > 0] == [Split(2, 4)]
    total = ScaleBounds(max_per_pool=4, max_total=3)
    assert [s for _, d, s in candidates(Split(1, 2), total, ROOM) if d > 0] == []
    assert [s for _, d, s in candidates(Split(1, 1), ScaleBounds(max_per_pool=1), ROOM) if d > 0] == []
    assert [s for _, d, s in candidates(Split(1, 6), BOUNDS, {}) if d < 0] == [Split(1, 5)]  # configured above
    with pytest.raises(ValueError):
        ScaleBounds(max_per_pool=-1)


def test_the_pd_ratio_target_is_kept():
    target = ScaleBounds(max_per_pool=4, pd_ratio=1.0)  # as many prefill as decode, within one
    priced = prices(p1d2=40.0, p1d3=95.0, p2d2=70.0)
    step = best_step(Split(1, 2), priced, target, ROOM, 5.0)
    assert step.target == Split(2, 2)  # 1P:3D predicts more, but is two off the target
    assert best_step(Split(1, 2), prices(p1d2=40.0, p1d3=95.0, p2d2=42.0), target, ROOM, 5.0) is None
    assert best_step(Split(1, 2), priced, BOUNDS, ROOM, 5.0).target == Split(1, 3)  # no target: the best


def test_the_policy_waits_for_confirmation_and_holds_after_a_step_and_a_veto():
    policy = ScalePolicy(BOUNDS, min_gain=5.0, confirmations=2, hold_s=20.0)
    priced = prices(p1d1=50.0, p1d2=90.0)
    assert policy.decide(0.0, Split(1, 1), priced, ROOM) is None  # seen once
    assert policy.decide(5.0, Split(1, 1), priced, ROOM).target == Split(1, 2)
    assert policy.decide(10.0, Split(1, 1), priced, ROOM) is None
    assert policy.decide(15.0, Split(1, 1), priced, ROOM) is None  # confirmed, but within the hold
    policy.veto(Split(1, 2), until=100.0)
    assert policy.decide(30.0, Split(1, 1), priced, ROOM) is None
    assert policy.decide(35.0, Split(1, 1), priced, ROOM) is None
    assert policy.decide(105.0, Split(1, 1), priced, ROOM) is None  # the veto over: seen once again
    assert policy.decide(110.0, Split(1, 1), priced, ROOM).target == Split(1, 2)


def test_room_for_a_whole_instance():
    bundle = {"CPU": 1.0}
    assert has_room([{"CPU": 1.0}], bundle, 1, one_node=True)
    assert not has_room([{"CPU": 0.5}], bundle, 1, one_node=True)
    assert not has_room([{"CPU": 1.0}, {"CPU": 1.0}], bundle, 2, one_node=True)  # TP: one node
    assert has_room([{"CPU": 1.0}, {"CPU": 1.0}], bundle, 2, one_node=False)  # PP: over nodes
    labelled = {"CPU": 1.0, "decode": 0.001}
    assert not has_room([{"CPU": 4.0, "prefill": 1.0}], labelled, 1, one_node=True)
    assert has_room([{"CPU": 4.0, "decode": 0.999}], labelled, 1, one_node=True)


def test_the_default_one_plus_one_deployment_replans_where_it_can_scale():
    assert replans(ServingConfig())  # 1 + 1: scaling may add
    assert not replans(ServingConfig.from_dict({"replan_scale": False}))
    assert replans(ServingConfig.from_dict({"replan_scale": False, "decode": {"num_instances": 2}}))
    assert not replans(ServingConfig.from_dict({"replan_max_instances": 1}))
    with pytest.raises(ValueError):
        ServingConfig.from_dict({"replan_pd_ratio": -1.0})


def model():
    return load_profile("deploy/profiles/smollm2-135m-cpu-1t.json").step_model(1, 1)


def test_the_live_state_one_instance_more_or_fewer():
    m = model()
    state = LiveState((
        LiveInstance("p0", "prefill", m, (100,)),
        LiveInstance("d0", "decode", m, (), (LiveDecode(50, 10),)),
        LiveInstance("d1", "decode", m, (), (LiveDecode(60, 5), LiveDecode(70, 5))),
    ))  # fmt: skip
    added = state.arrange(Split(2, 2))
    assert [i.instance_id for i in added.members["prefill"]] == ["p0", "new-prefill"]
    assert added.joining == frozenset({"new-prefill"}) and added.prompts["p0"] == [100]
    removed = state.arrange(Split(1, 1))
    assert [i.instance_id for i in removed.members["decode"]] == ["d1"]  # d0, the least busy, leaves
    assert len(removed.decodes["d1"]) == 3 and "d0" not in removed.decodes  # its decode moved
    with pytest.raises(ValueError):
        state.arrange(Split(0, 2))  # never the last of a pool


def test_scale_steps_priced_from_the_live_state_a_decode_more_helps_a_decode_heavy_load():
    profile = load_profile("deploy/profiles/smollm2-135m-cpu-1t.json")
    config = ServingConfig.from_dict({"engine": {"num_kv_blocks": 1024}, "slo": {"ttft_ms": 1500, "tpot_ms": 60}})
    m = profile.step_model(1, 1)
    busy = tuple(LiveDecode(200, 200) for _ in range(48))
    state = LiveState((LiveInstance("p0", "prefill", m), LiveInstance("d0", "decode", m, (), busy)))
    requests = [SimRequest(i, 0.25 * i, 30, 100) for i in range(32)]
    priced = price_splits(config, {"prefill": profile, "decode": profile}, state, requests, 8.0,
                          splits=[Split(1, 1), Split(1, 2), Split(2, 1)], launch_s=0.5)  # fmt: skip
    assert set(priced) == {Split(1, 1), Split(1, 2), Split(2, 1)}
    assert priced[Split(1, 2)].attainment > priced[Split(1, 1)].attainment


def test_an_add_is_judged_on_the_traffic_it_joins_in_time_to_serve():
    """An added instance serves LAUNCH_S from now, after the default window's last arrival: priced
    on the window alone, the split with it predicted what staying did (each request placed before it
    joined), so the default loop never added one. Every split is judged on the window's traffic
    going on until a window's worth arrives once it serves."""
    profile = load_profile("deploy/profiles/smollm2-135m-cpu-1t.json")
    config = ServingConfig.from_dict({"engine": {"num_kv_blocks": 1024}, "slo": {"ttft_ms": 3000, "tpot_ms": 40}})
    window_s = config.replan_window_s
    assert LAUNCH_S > window_s
    m = profile.step_model(1, 1)
    state = LiveState((LiveInstance("p0", "prefill", m),
                       LiveInstance("d0", "decode", m, (), tuple(LiveDecode(60, 60) for _ in range(20)))))  # fmt: skip
    requests = [SimRequest(i, i / 4, 24, 112) for i in range(60)]  # 4 req/s, decode-heavy: one decode misses
    priced = price_splits(config, {"prefill": profile, "decode": profile}, state, requests, window_s,
                          splits=[Split(1, 1), Split(1, 2), Split(2, 1)])  # fmt: skip
    assert priced[Split(1, 2)].attainment >= priced[Split(1, 1)].attainment + config.replan_min_gain, priced
    assert priced[Split(2, 1)].attainment < priced[Split(1, 2)].attainment  # a prefill more does not help


def test_the_window_goes_on_as_it_came():
    requests = [SimRequest(0, 0.0, 10, 5), SimRequest(1, 4.0, 20, 6)]
    longer = extended(requests, 10.0, 25.0)
    assert [(r.index, r.arrival_s, r.prompt_len) for r in longer] == [
        (0, 0.0, 10), (1, 4.0, 20), (2, 10.0, 10), (3, 14.0, 20), (4, 20.0, 10), (5, 24.0, 20)
    ]  # fmt: skip


def test_an_idle_window_fits_in_fewer():
    profile = load_profile("deploy/profiles/smollm2-135m-cpu-1t.json")
    config = ServingConfig.from_dict({"slo": {"ttft_ms": 1500, "tpot_ms": 60}})
    m = profile.step_model(1, 1)
    state = LiveState(
        (LiveInstance("p0", "prefill", m), LiveInstance("d0", "decode", m), LiveInstance("d1", "decode", m))
    )
    priced = price_splits(config, {"prefill": profile, "decode": profile}, state, [], 15.0,
                          splits=[Split(1, 2), Split(1, 1)])  # fmt: skip
    assert priced == {Split(1, 2): Price(100.0, 0.0), Split(1, 1): Price(100.0, 0.0)}  # nothing arrives: nothing missed
    step = best_step(Split(1, 2), priced, BOUNDS, {}, 5.0)
    assert step is not None and (step.role, step.delta) == ("decode", -1)


def test_a_removal_is_judged_on_the_load_going_on_not_only_the_next_window():
    """One prefill instance fewer, just past its capacity, falls behind slowly: within one window
    its queue stays under the TTFT target. The load going on (LAUNCH_S and a window) shows it
    does not fit, so no instance is removed under it."""
    profile = load_profile("deploy/profiles/smollm2-135m-cpu-1t.json")
    config = ServingConfig.from_dict({"engine": {"num_kv_blocks": 2048}, "slo": {"ttft_ms": 4000, "tpot_ms": 0}})
    m = profile.step_model(1, 1)
    state = LiveState(
        (LiveInstance("p0", "prefill", m), LiveInstance("p1", "prefill", m), LiveInstance("d0", "decode", m))
    )
    requests = [SimRequest(i, i / 1.1, 700, 6) for i in range(16)]  # 700-token prompts at 1.1 req/s, ~1 s each
    priced = price_splits(config, {"prefill": profile, "decode": profile}, state, requests, 15.0,
                          splits=[Split(2, 1), Split(1, 1)])  # fmt: skip
    assert priced[Split(2, 1)].attainment == 100.0 and priced[Split(1, 1)].attainment < 95.0, priced
    assert best_step(Split(2, 1), priced, BOUNDS, {}, 5.0) is None
