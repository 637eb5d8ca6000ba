"""The re-planner's decisions (disagg.planner.replanner): it picks the split the simulator ranks
first for the traffic of its window, and its hysteresis keeps it from oscillating on a load that
crosses the threshold back and forth."""

from __future__ import annotations

import random

import pytest

from disagg.config import ServingConfig
from disagg.placement.profile import load_profile
from disagg.planner.replanner import Replanner, Split, TrafficWindow, reachable_splits, split_simulator
from disagg.planner.simulator import slo_attainment
from disagg.slo import SLO

PROFILE = "deploy/profiles/smollm2-135m-cpu-1t.json"
TTFT_MS, TPOT_MS = 1500.0, 120.0
SLO_ = SLO(TTFT_MS, TPOT_MS)


def _window(prompt: tuple[int, int], output: tuple[int, int], rate: float, seconds: float, seed: int = 0):
    rng, window, t = random.Random(seed), TrafficWindow(window_s=seconds), 0.0
    while t < seconds:
        window.add(t, rng.randint(*prompt), rng.randint(*output))
        t += rng.expovariate(rate)
    return window, t


@pytest.fixture(scope="module")
def simulate():
    config = ServingConfig.from_dict(
        {
            "mode": "disaggregated",
            "engine": {"num_kv_blocks": 2048, "max_num_batched_tokens": 512},
            "prefill": {"num_instances": 1},
            "decode": {"num_instances": 1},
            "slo": {"ttft_ms": TTFT_MS, "tpot_ms": TPOT_MS},
        }
    )
    profile = load_profile(PROFILE)
    return split_simulator(config, {"prefill": profile, "decode": profile})


def test_reachable_splits_keep_one_instance_in_each_pool():
    assert reachable_splits(3) == [Split(1, 2), Split(2, 1)]
    with pytest.raises(ValueError):
        reachable_splits(1)


@pytest.mark.parametrize(
    "prompt,output,rate,expected_side",
    [((700, 900), (4, 8), 1.5, "prefill"), ((20, 40), (150, 200), 8.0, "decode")],
    ids=["prefill-heavy", "decode-heavy"],
)
def test_the_replanner_picks_the_split_the_simulator_ranks_first(simulate, prompt, output, rate, expected_side):
    window, now = _window(prompt, output, rate=rate, seconds=30)
    requests = window.requests(now)
    ranked = {s: slo_attainment(simulate(s, requests), SLO_) for s in reachable_splits(4)}
    planner = Replanner(simulate, 4, SLO_, confirmations=1, hold_s=0)
    decision = planner.decide(now, Split(2, 2), window)
    assert decision.predicted == ranked
    assert ranked[decision.best] == max(ranked.values())
    # The traffic's own side gets the instances (the simulator's answer is not arbitrary).
    more = (
        decision.best.prefill > decision.best.decode
        if expected_side == "prefill"
        else decision.best.decode > decision.best.prefill
    )
    assert more, decision
    if decision.best != Split(2, 2) and decision.gain >= planner.min_gain:
        assert decision.switch_to == Split(2, 2).toward(decision.best)


def _scripted(predictions: list[dict[Split, float]]):
    """A simulator stand-in whose attainments follow a script, one entry per decision."""
    calls = iter(predictions)
    current: dict[Split, float] = {}

    def simulate(split: Split, requests):
        nonlocal current
        if split == Split(1, 2):  # the first split each decision asks about: the next entry
            current = next(calls)
        good = round(current[split])
        return [_Record(ok=i < good) for i in range(100)]

    return simulate


class _Record:
    def __init__(self, ok: bool):
        self.success, self.ttft_s, self.tpot_s = ok, 0.0, 0.0


def test_a_load_that_crosses_the_threshold_back_and_forth_never_switches():
    # The best alternates between the two splits each window, each time by more than min_gain.
    flip = [{Split(1, 2): 90.0, Split(2, 1): 80.0}, {Split(1, 2): 80.0, Split(2, 1): 90.0}] * 10
    planner = Replanner(_scripted(flip), 3, SLO_, min_gain=5, confirmations=2, hold_s=0)
    current = Split(1, 2)
    for i in range(len(flip)):
        decision = planner.decide(10.0 + i, current, _recent(10.0 + i))
        assert decision.switch_to is None, decision
    assert all(d.switch_to is None for d in planner.history)


def test_a_sustained_shift_switches_once_one_instance_at_a_time_and_holds():
    shifted = [{Split(1, 2): 60.0, Split(2, 1): 95.0}] * 12
    planner = Replanner(_scripted(shifted), 3, SLO_, min_gain=5, confirmations=2, hold_s=5)
    current, switches = Split(1, 2), []
    for i in range(len(shifted)):
        decision = planner.decide(10.0 + i, current, _recent(10.0 + i))
        if decision.switch_to is not None:
            switches.append((i, decision.switch_to))
            current = decision.switch_to
    assert switches == [(1, Split(2, 1))]  # on the second confirming window; then it holds there
    small = [{Split(1, 2): 90.0, Split(2, 1): 93.0}] * 4  # 3 points: below min_gain, no switch
    planner = Replanner(_scripted(small), 3, SLO_, min_gain=5, confirmations=1, hold_s=0)
    assert all(planner.decide(10.0 + i, Split(1, 2), _recent(10.0 + i)).switch_to is None for i in range(4))


def _recent(now: float, count: int = 20) -> TrafficWindow:
    """`count` requests in the 10 s before `now` (the scripted simulator ignores their lengths)."""
    window = TrafficWindow(window_s=10.0)
    for i in range(count):
        window.add(now - 10.0 + 10.0 * i / count, 50, 20)
    return window


def test_sparse_long_requests_are_priced_from_a_stretched_window_not_ignored():
    """Six 800-token prompts in 15 s (0.4 req/s) are the load a split matters most for: the round
    reaches back for the latest eight (up to two windows) instead of deciding nothing."""
    window = TrafficWindow(window_s=15.0)
    for i in range(16):  # one every 2.5 s over the last 40 s
        window.add(100.0 - 40.0 + 2.5 * i, 800, 6)
    assert len(window.requests(100.0)) == 6, "the window itself holds six"
    priced = window.for_pricing(100.0)
    assert len(priced) == 8 and priced[0].arrival_s == 0.0 and priced[-1].arrival_s == pytest.approx(17.5)
    ranked = [{Split(1, 2): 20.0, Split(2, 1): 80.0}] * 2
    planner = Replanner(_scripted(ranked), 3, SLO_, confirmations=1, hold_s=0)
    assert planner.decide(100.0, Split(1, 2), window).switch_to == Split(2, 1)
    stale = TrafficWindow(window_s=15.0)
    for t in (40.0, 45.0, 95.0):  # nothing older than two windows is replayed
        stale.add(t, 800, 6)
    assert len(stale.for_pricing(100.0)) == 1


def test_a_shift_in_the_traffic_is_priced_from_the_latest_half_window_alone():
    """Prefill-heavy traffic, then decode-heavy for the last 6 s of a 15 s window: the round
    prices the decode-heavy half twice over (its rate kept), not the mix; steady traffic, and a
    half too sparse to tell, are priced as they came."""
    window = TrafficWindow(window_s=15.0)
    for i in range(6):  # 800-token prompts, one every 1.5 s, from 84 to 91.5 s
        window.add(84.0 + 1.5 * i, 800, 6)
    for i in range(8):  # then short prompts with long outputs, 4 a second from 93 s
        window.add(93.0 + 0.25 * i + 2.0 * (i // 4), 30, 175)
    priced = window.for_pricing(100.0)
    latest = [r for r in window.requests(100.0) if r.prompt_len == 30]
    assert [r.prompt_len for r in priced] == [30] * 16, "the shifted half alone, twice"
    assert [r.arrival_s for r in priced[8:]] == pytest.approx([r.arrival_s + 7.5 for r in priced[:8]])
    assert [r.arrival_s for r in priced[:8]] == pytest.approx([r.arrival_s - latest[0].arrival_s for r in latest])
    assert [r.index for r in priced] == list(range(16))
    steady = TrafficWindow(window_s=15.0)
    for i in range(14):
        steady.add(86.0 + i, 600 if i % 2 else 900, 6 if i % 3 else 8)
    assert len(steady.for_pricing(100.0)) == 14, "one kind of traffic: the window as it came"
    sparse = TrafficWindow(window_s=15.0)
    for t, prompt, output in [(86.0, 800, 6), (88.0, 800, 6), (90.0, 800, 6), (91.0, 800, 6), (95.0, 30, 175)]:
        sparse.add(t, prompt, output)
    assert len(sparse.for_pricing(100.0)) == 5, "one request in the latest half tells nothing"
