"""One SLO type and one "met the SLO" rule (disagg.slo) for the router, the metrics, the
simulator, the planner, the proto conversion and every benchmark (issue 50, item 4): each former
user is shown to call the rule (a spy in its place says so), and no module writes a rule of its
own (no SLO class elsewhere, no comparison of a measured TTFT or TPOT against a target outside
disagg/slo.py)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from disagg.bench.metrics import RequestRecord
from disagg.slo import SLO, met, missed, parse_slo, tpot_s
from disagg.v1 import serving_pb2

REPO = Path(__file__).resolve().parents[2]


# ---- the rule --------------------------------------------------------------------------------------
def test_a_target_of_zero_is_none_and_the_limits_are_inclusive():
    slo = SLO(ttft_ms=500, tpot_ms=50)
    assert met(slo, 500, 50) and not met(slo, 500.1, 50) and not met(slo, 500, 50.1)
    assert met(SLO(), math.inf, math.inf) and met(SLO(tpot_ms=50), 10_000, 50)
    assert missed(slo, 600, 60) == ["TTFT > 500 ms", "TPOT > 50 ms"] and missed(slo, 1, 1) == []


def test_tpot_is_vllms():
    assert tpot_s(1.0, 0.1, 10) == pytest.approx(0.1) and tpot_s(1.0, 0.1, 1) == 0.0


def test_the_one_type_checks_itself_and_reads_every_form_it_comes_in():
    for bad in (-1, math.nan, "5", True):
        with pytest.raises(ValueError):
            SLO(ttft_ms=bad)
    assert SLO.from_dict({"ttft_ms": 5}) == SLO(5, 0) and parse_slo("tpot:20") == SLO(0, 20)
    with pytest.raises(ValueError, match="e2el_ms"):
        SLO.from_dict({"e2el_ms": 5})
    assert SLO.of(serving_pb2.Slo(ttft_ms=300), SLO(500, 50)) == SLO(300, 50)  # 0 on the wire: the server's


# ---- every former user calls it --------------------------------------------------------------------
class Spy:
    def __init__(self):
        self.calls = []

    def __call__(self, slo, ttft_ms, tpot_ms):
        self.calls.append((slo, ttft_ms, tpot_ms))
        return met(slo, ttft_ms, tpot_ms)


def spied(monkeypatch, module) -> Spy:
    spy = Spy()
    monkeypatch.setattr(module, "met", spy)
    return spy


def test_the_router_counts_a_finished_request_by_the_rule(monkeypatch):
    from disagg.router import request_path
    from disagg.router.stream_stats import Outcome

    spy = spied(monkeypatch, request_path)
    outcome = Outcome("length", 10, 5, 0, 0, 0, 0, 0, 0, 0.2, 0.6, (), "p", "d", 0, 0)
    assert not request_path.meets_slo(outcome, SLO(300, 50))  # TPOT (0.6 - 0.2) / 4 = 100 ms: over 50
    assert spy.calls == [(SLO(300, 50), pytest.approx(200), pytest.approx(100))]


def test_the_simulator_planner_and_replanner_judge_by_the_rule(monkeypatch):
    from disagg.planner import simulator
    from disagg.planner.replan_sim import goodput

    spy = spied(monkeypatch, simulator)
    record = simulator.SimRecord(0, 0.0, 10, 5, first_token_s=0.1, finish_s=0.5)
    assert simulator.slo_attainment([record], SLO(200, 200)) == 100.0
    assert goodput([record], SLO(50, 0), 1.0) == 0.0  # the re-planner's simulated runs: the same rule
    assert len(spy.calls) == 2 and spy.calls[0][1] == pytest.approx(100)


def test_the_searchs_percentile_check_is_the_rule_too(monkeypatch):
    from disagg.planner import search
    from disagg.planner.simulator import SimRecord

    spy = spied(monkeypatch, search)
    records = [SimRecord(i, 0.0, 10, 5, first_token_s=0.1, finish_s=0.5) for i in range(10)]
    holder = search.Search(None, [], [], SLO(200, 200))
    assert holder.holds(records)
    assert spy.calls and all(slo == SLO(200, 200) for slo, _, _ in spy.calls)


def test_the_benchmarks_metrics_and_tally_judge_by_the_rule(monkeypatch):
    from disagg.bench import metrics
    from disagg.bench.slo_tally import SloTally

    spy = spied(monkeypatch, metrics)
    record = RequestRecord(0, 10, 5, success=True, output_len=5, ttft=0.1, e2el=0.5)
    tally = SloTally(SLO(200, 50))
    tally.add(record)
    summary = metrics.summarize([record], 1.0, SLO(200, 50))
    assert tally.good == 0 and summary["num_good"] == 0  # TPOT 100 ms
    assert len(spy.calls) == 2 and spy.calls[0][2] == pytest.approx(100)


# ---- nobody writes a rule of their own -------------------------------------------------------------
SOURCES = [p for folder in ("disagg", "loadtest") for p in (REPO / folder).rglob("*.py") if "/v1/" not in str(p)]
# A predicted step or batch against a target, not a request's outcome judged: placement's own.
PREDICTIONS = {"disagg/placement/goodput.py", "disagg/placement/rebalance.py"}
OWN_RULE = re.compile(r"(ttft|tpot|percentile)\w*\b[^,\n]{0,40}(<=|>=|<|>)\s*[\w.\[\]\"']*(ttft|tpot)_ms\b")


def test_no_other_slo_type_exists():
    for path in SOURCES:
        text = path.read_text()
        assert not re.search(r"^class (Slo|SLO|SLOConfig)\b", text, re.MULTILINE) or path.name == "slo.py", path
        assert "SLOConfig" not in text, path


def test_no_module_compares_a_measured_latency_with_a_target_itself():
    for path in SOURCES:
        relative = str(path.relative_to(REPO))
        if relative in PREDICTIONS or relative == "disagg/slo.py":
            continue
        found = OWN_RULE.search(path.read_text())
        assert found is None, f"{relative} judges a request itself ({found.group(0)!r}): use disagg.slo.met"
