"""`loadtest.planner.verify`'s own logic: which modes are measured beside the pick, the rates
swept around a prediction, and the verdict (is the pick the measured winner, how far off is its
predicted rate)."""

from __future__ import annotations

import pytest

from disagg.planner.host_plan import HostPlan
from disagg.planner.search import Candidate, PoolPlan
from loadtest.planner.verify import modes_to_measure, sweep, verdict


def plan(mode: str, hardware: str, rate: float, policy: str = "chunked") -> HostPlan:
    if mode == "disaggregated":
        pools = {"prefill": PoolPlan(1, 1, 1, hardware), "decode": PoolPlan(1, 1, 1, hardware)}
    else:
        pools = {"colocated": PoolPlan(1, 1, 1, hardware, policy, 512)}
    return HostPlan(Candidate(mode, pools, rate), search=None, per_device_rate=rate)


PLANS = [  # best first, as host_plans returns them
    plan("colocated", "cpu-2t", 5.0),
    plan("colocated", "cpu-1t", 4.5),
    plan("disaggregated", "cpu-1t", 4.0),
    plan("colocated", "cpu-2t", 3.0, "prefill_first"),
]


def test_the_pick_is_measured_once_beside_the_best_of_each_other_mode():
    chosen = modes_to_measure(PLANS)
    assert list(chosen) == ["pick", "disaggregated", "colocated-prefill-first-2t"]
    assert chosen["pick"] is PLANS[0]  # also the best chunked 2-thread plan: not measured twice
    assert chosen["disaggregated"] is PLANS[2]
    assert chosen["colocated-prefill-first-2t"] is PLANS[3]


def test_the_sweep_brackets_the_prediction_and_lasts_long_enough():
    rates, requests = sweep(5.0)
    assert rates[0] < 5.0 < rates[-1]
    assert requests >= 5.0 * 60  # a minute of arrivals at the prediction


def test_the_pick_that_measures_best_within_ten_percent_passes():
    chosen = modes_to_measure(PLANS)
    result = verdict(chosen, {"pick": 4.7, "disaggregated": 3.1, "colocated-prefill-first-2t": None})
    assert result["measured_winner"] == "pick" and result["pick_is_winner"]
    assert result["errors"]["pick"] == pytest.approx(0.3 / 4.7)
    assert result["pick_within_10pct"]
    assert result["errors"]["colocated-prefill-first-2t"] is None  # its sweep did not cross 90%


def test_a_pick_beaten_by_another_mode_or_far_off_fails():
    chosen = modes_to_measure(PLANS)
    beaten = verdict(chosen, {"pick": 4.0, "disaggregated": 4.2, "colocated-prefill-first-2t": 2.0})
    assert beaten["measured_winner"] == "disaggregated" and not beaten["pick_is_winner"]
    assert not beaten["pick_within_10pct"]  # predicted 5.0 against 4.0 measured: +25%
    unmeasured = verdict(chosen, {"pick": None, "disaggregated": 3.0, "colocated-prefill-first-2t": None})
    assert not unmeasured["pick_is_winner"] and not unmeasured["pick_within_10pct"]
