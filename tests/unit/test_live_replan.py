"""Re-planning priced on the live state and checked by measurement (issue 53, items 1-2), as pure
logic: which instance a split moves and where its work goes, the simulator started from queues
and decodes in flight, each instance's own model, the host factor of measured steps, per-request
SLOs, the KV element size, and a switch's check (undo, residual, sign). No Ray."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest

from disagg.config import EngineConfig, ServingConfig
from disagg.engine.memory_fit import kv_element_bytes
from disagg.placement.profile import load_profile
from disagg.planner.decision_check import CHECK_PATIENCE_HOLDS, Check, DecisionChecker
from disagg.planner.live_pricing import Price, price_split
from disagg.planner.live_state import MAX_FACTOR, LiveDecode, LiveInstance, LiveState, enough_to_price, host_factor
from disagg.planner.replanner import MIN_WINDOW_REQUESTS, Replanner, Split, TrafficWindow
from disagg.planner.simulator import num_met
from disagg.planner.workload import SimRequest
from disagg.request import Request, SamplingParams
from disagg.slo import SLO
from disagg.step_work import Chunk, MeasuredStep, StepWork
from disagg.worker.heartbeat import running_decodes

PROFILE = "deploy/profiles/smollm2-135m-cpu-1t.json"
SLO_ = SLO(ttft_ms=1500.0, tpot_ms=120.0)


@pytest.fixture(scope="module")
def setup():
    config = ServingConfig.from_dict(
        {
            "engine": {"num_kv_blocks": 1024, "max_num_batched_tokens": 512},
            "prefill": {"num_instances": 2},
            "decode": {"num_instances": 1},
            "slo": SLO_.to_dict(),
        }
    )
    profile = load_profile(PROFILE)
    return config, {"prefill": profile, "decode": profile}, profile.step_model(1, 1)


def decode_heavy(n: int = 16, rate: float = 2.0) -> list[SimRequest]:
    rng, t, requests = random.Random(1), 0.0, []
    for i in range(n):
        requests.append(SimRequest(i, t, rng.randint(20, 40), rng.randint(40, 60)))
        t += rng.expovariate(rate)
    return requests


def live(model, prompts=((), (), ()), decodes=((), (), ()), models=None) -> LiveState:
    ids = [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")]
    models = models or [model] * 3
    return LiveState(
        tuple(LiveInstance(i, role, m, tuple(q), tuple(d)) for (i, role), m, q, d in zip(ids, models, prompts, decodes))
    )


# ---- the live state and the split that moves it ---------------------------------------------------
def test_a_split_moves_the_least_busy_instance_and_rehomes_its_work(setup):
    _, _, model = setup
    state = live(model, prompts=((500, 300), (200,), ()), decodes=((), (), (LiveDecode(100, 20),)))
    assert state.split == Split(2, 1)
    stay = state.arrange(Split(2, 1))
    assert [i.instance_id for i in stay.members["prefill"]] == ["p0", "p1"] and not stay.joining
    moved = state.arrange(Split(1, 2))
    assert moved.joining == {"p1"}, "p1 holds 1 request, p0 2: p1 moves"
    assert [i.instance_id for i in moved.members["decode"]] == ["d0", "p1"]
    assert sorted(moved.prompts["p0"]) == [200, 300, 500], "its queued prompt goes to the prefill that stays"
    assert moved.decodes["d0"] == [LiveDecode(100, 20)]
    with pytest.raises(ValueError):
        state.arrange(Split(3, 2))  # two instances more: not one step (one more is scaling's)


def test_decodes_in_flight_and_queued_prompts_cost_what_an_empty_system_does_not(setup):
    config, profiles, model = setup
    requests = decode_heavy()
    empty = price_split(config, profiles, live(model), Split(2, 1), requests, 8.0)
    busy = live(
        model, prompts=((800,) * 4, (800,) * 4, ()), decodes=((), (), tuple(LiveDecode(900, 300) for _ in range(40)))
    )
    loaded = price_split(config, profiles, busy, Split(2, 1), requests, 8.0)
    assert empty.attainment > loaded.attainment + 20, (empty, loaded)
    assert loaded.goodput < empty.goodput


def test_each_instance_prices_with_its_own_model(setup):
    config, profiles, model = setup
    requests = decode_heavy()
    same = price_split(config, profiles, live(model), Split(2, 1), requests, 8.0)
    slow_decode = live(model, models=[model, model, model.scaled(6.0)])
    assert price_split(config, profiles, slow_decode, Split(2, 1), requests, 8.0).attainment < same.attainment - 20


def test_a_moved_instance_takes_work_only_once_its_switch_is_done(setup):
    config, profiles, model = setup
    requests = decode_heavy()
    crowded = live(model, decodes=((), (), tuple(LiveDecode(200, 150) for _ in range(64))))  # d0 past the TPOT SLO
    assert price_split(config, profiles, crowded, Split(2, 1), requests, 8.0).attainment == 0.0
    assert price_split(config, profiles, crowded, Split(1, 2), requests, 8.0, switch_s=0.0).attainment == 100.0
    assert price_split(config, profiles, crowded, Split(1, 2), requests, 8.0, switch_s=30.0).attainment == 0.0


def test_the_host_factor_is_the_median_of_measured_over_modelled_steps(setup):
    _, _, model = setup
    work = [StepWork(num_decodes=8, decode_context_sum=800), StepWork(chunks=(Chunk(0, 256),))]
    steps = [MeasuredStep(w, model.step_ms(w) * k) for w, k in zip(work * 2, (2.0, 2.0, 2.5, 1.5))]
    assert host_factor(steps, model) == pytest.approx(2.0)
    assert host_factor([], model) == 1.0
    assert host_factor([MeasuredStep(work[0], 1e9)], model) == MAX_FACTOR


# ---- what a round prices with ------------------------------------------------------------------------
def test_requests_are_judged_by_their_own_slo_and_the_window_carries_it():
    window = TrafficWindow(window_s=10.0)
    window.add(1.0, 100, 40, SLO(ttft_ms=50.0), priority=-1)
    window.add(2.0, 200, 20)
    first, second = window.requests(5.0)
    assert (first.output_len, first.slo, first.priority) == (40, SLO(ttft_ms=50.0), -1) and second.slo is None
    assert [r.prompt_len for r in window.requests(5.0, since=1.5)] == [200]
    record = SimpleNamespace(success=True, ttft_s=0.1, tpot_s=0.01, slo=SLO(ttft_ms=50.0))
    assert num_met([record], SLO(ttft_ms=500.0)) == 0, "100 ms misses its own 50 ms"
    assert num_met([SimpleNamespace(**{**vars(record), "slo": None})], SLO(ttft_ms=500.0)) == 1


def test_kv_bytes_follow_the_real_element_size():
    assert kv_element_bytes(EngineConfig(model="m", device="cpu")) == 4, "CPU's dtype auto is float32"
    assert kv_element_bytes(EngineConfig(model="m", device="cpu", dtype="bfloat16")) == 2
    assert kv_element_bytes(EngineConfig(model="m", device="cuda", weights="auto")) == 2


def test_a_worker_reports_each_decode_with_the_output_it_expects_still():
    def request(prompt, out, max_tokens, predicted=None):
        r = Request("r", [1] * prompt, SamplingParams(max_tokens=max_tokens), predicted_output_len=predicted)
        r.num_computed_tokens = prompt + out
        r.output_token_ids.extend([2] * out)
        r.token_ids.extend([2] * out)
        return r

    prefilling = Request("p", [1] * 64, SamplingParams(max_tokens=8))
    running = [request(100, 10, 200), request(50, 5, 200, predicted=30), prefilling]
    assert running_decodes(running) == [[110, 190], [55, 25]]


# ---- a switch checked against what followed ----------------------------------------------------------
def check(predicted=80.0, stay=50.0) -> Check:
    return Check(0.0, Split(2, 1), Split(1, 2), Price(predicted, 4.0), Price(stay, 2.5), opens_at=0.0)


def test_a_switch_that_measured_worse_than_staying_is_undone_and_its_miss_learnt():
    checker = DecisionChecker(margin=5.0)
    c = check()
    checker.open(c)
    assert checker.pending is c
    # On the window after it, priced again: 1P:2D 70, 2P:1D 65; measured 40: staying would have
    # measured about 40 + (65 - 70) = 35 -> kept, the miss (40 - 70 = -30) learnt.
    priced = {Split(1, 2): Price(70.0, 3.5), Split(2, 1): Price(65.0, 3.2)}
    assert checker.close(c, Price(40.0, 2.0), priced) == "kept" and checker.pending is None
    assert c.stay.attainment == pytest.approx(35.0) and checker.residuals[Split(1, 2)] == pytest.approx(-30.0)
    assert c.sign_right is True
    worse = check()
    checker.open(worse)
    priced = {Split(1, 2): Price(50.0, 2.5), Split(2, 1): Price(80.0, 4.0)}
    assert checker.close(worse, Price(45.0, 2.2), priced) == "undone", "staying: 45 + 30 = 75"
    assert worse.sign_right is False and checker.sign_share() == 0.5
    assert checker.residuals[Split(1, 2)] == pytest.approx(0.5 * -30.0 + 0.5 * -5.0)


def test_later_predictions_carry_the_residual_of_their_split():
    checker = DecisionChecker()
    checker.learn(Split(1, 2), -20.0)
    assert checker.corrected(Split(1, 2), Price(80.0, 4.0)) == Price(60.0, 3.0)
    assert checker.corrected(Split(2, 1), Price(80.0, 4.0)) == Price(80.0, 4.0)
    assert checker.corrected(Split(1, 2), Price(10.0, 1.0)).attainment == 0.0


def test_the_pricing_process_is_bounded_and_every_wait_times_out():
    import asyncio

    from disagg.router.replan_pricer import PricingBusy, PricingPool

    async def scenario():
        pool = PricingPool(timeout_s=0.5)
        try:
            slow = asyncio.ensure_future(pool.run(time.sleep, 30))
            await asyncio.sleep(0)
            with pytest.raises(PricingBusy):
                await pool.run(abs, -3)
            with pytest.raises((TimeoutError, asyncio.TimeoutError)):
                await slow
            pool.timeout_s = 60.0
            assert await pool.run(abs, -3) == 3, "a fresh worker after the stuck one was ended"
        finally:
            pool.close()

    asyncio.run(scenario())


def test_disagg_status_shows_a_checked_switch_predicted_beside_measured(capsys):
    from disagg.cli import _print_replanning
    from disagg.router.frontend import _replan_decision
    from disagg.router.replanning import LoggedDecision
    from disagg.planner.replanner import Decision
    from disagg.v1 import serving_pb2

    c = check()
    DecisionChecker().close(c, Price(40.0, 2.0), {Split(1, 2): Price(70.0, 3.5), Split(2, 1): Price(65.0, 3.2)})
    entry = LoggedDecision(time.time(), Decision(0.0, Split(2, 1), Split(1, 2), {}, Split(1, 2), "r"), check=c)
    _print_replanning(serving_pb2.ClusterStatusResponse(replan=True, replan_decisions=[_replan_decision(entry)]))
    assert (
        "checked: kept; predicted 80.0% / 4.00 req/s, measured 40.0% / 2.00 req/s, staying 35.0%"
        in capsys.readouterr().out
    )


def test_a_check_short_of_requests_waits_for_them_instead_of_closing_unmeasured():
    """At a low rate a hold's span holds fewer than MIN_WINDOW_REQUESTS arrivals: the check waits
    (up to CHECK_PATIENCE_HOLDS), so that a switch that measured worse can still be undone."""
    c = Check(10.0, Split(2, 1), Split(1, 2), Price(90.0, 1.0), Price(40.0, 0.5), opens_at=12.0)
    assert c.readiness(30.0, hold_s=20.0, judged=3, arrived=5) == "wait"
    assert c.readiness(45.0, hold_s=20.0, judged=4, arrived=MIN_WINDOW_REQUESTS) == "measure"
    assert c.readiness(30.0, hold_s=20.0, judged=0, arrived=MIN_WINDOW_REQUESTS) == "wait"
    assert c.readiness(10.0 + CHECK_PATIENCE_HOLDS * 20.0, hold_s=20.0, judged=3, arrived=5) == "unmeasured"


def test_a_full_system_with_sparse_arrivals_is_priced_not_ignored():
    """Five arrivals in the window while the decode instance holds six long decodes: the round
    simulates eleven requests, enough to tell the splits apart (before, it needed eight arrivals
    and decided nothing); a window with no arrival, or few of both, is not priced."""
    assert enough_to_price(5, 6) and not enough_to_price(5, 0) and not enough_to_price(0, 20)
    assert enough_to_price(MIN_WINDOW_REQUESTS, 0) and not enough_to_price(2, 2)
    window = TrafficWindow(window_s=15.0)
    for t in (90.0, 93.0, 96.0, 98.0, 99.0):
        window.add(t, 30, 600)
    planner = Replanner(lambda split, requests: [], 3, SLO(ttft_ms=3000.0), confirmations=1, hold_s=0.0)
    decision = planner.decide(100.0, Split(2, 1), window, {Split(2, 1): 40.0, Split(1, 2): 95.0})
    assert decision.switch_to == Split(1, 2), decision.reason
