"""Benchmark metrics as vLLM's `bench serve` defines them, checked against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from disagg.bench.metrics import (
    median_ci,
    median_difference_ci,
    RequestRecord,
    TokenTimer,
    distribution_ms,
    meets_slo,
    read_rows,
    record_row,
    summarize,
)
from disagg.bench.open_loop import LoadConfig, arrival_times
from disagg.slo import SLO, parse_slo


def ok(ttft: float, e2el: float, output_len: int, itl=None, prompt_len: int = 10) -> RequestRecord:
    return RequestRecord(
        index=0,
        prompt_len=prompt_len,
        target_output_len=output_len,
        success=True,
        output_len=output_len,
        ttft=ttft,
        e2el=e2el,
        itl=itl or [],
    )


def failed(code: str = "RESOURCE_EXHAUSTED") -> RequestRecord:
    return RequestRecord(index=0, prompt_len=10, target_output_len=5, error_code=code, e2el=0.01)


def test_tpot_is_decode_time_over_output_tokens_after_the_first():
    assert ok(ttft=0.1, e2el=1.0, output_len=10).tpot == pytest.approx(0.1)
    assert ok(ttft=0.25, e2el=0.75, output_len=3).tpot == pytest.approx(0.25)
    assert ok(ttft=0.2, e2el=0.2, output_len=1).tpot == 0.0  # undefined: vLLM leaves such requests out


def test_token_timer_spreads_a_multi_token_message_over_its_gap():
    timer = TokenTimer(started=10.0)
    timer.on_message(0, 10.2)  # a message without tokens changes nothing
    timer.on_message(1, 10.5)
    timer.on_message(2, 10.7)
    timer.on_message(0, 10.8)
    timer.on_message(1, 11.0)
    record = timer.finish(RequestRecord(index=0, prompt_len=4, target_output_len=4), now=11.0)
    assert record.success and record.output_len == 4
    assert record.ttft == pytest.approx(0.5) and record.e2el == pytest.approx(1.0)
    assert record.itl == pytest.approx([0.1, 0.1, 0.3])
    assert record.tpot == pytest.approx(0.5 / 3)
    assert sum(record.itl) == pytest.approx(record.e2el - record.ttft)


def test_extra_tokens_in_the_first_message_have_no_gap():
    timer = TokenTimer(started=0.0)
    timer.on_message(3, 0.4)
    timer.on_message(1, 0.6)
    record = timer.finish(RequestRecord(index=0, prompt_len=4, target_output_len=4), now=0.6)
    assert record.itl == pytest.approx([0.0, 0.0, 0.2]) and record.ttft == pytest.approx(0.4)


def test_distribution_uses_linear_interpolation_percentiles_in_ms():
    d = distribution_ms([float(s) for s in range(1, 11)])
    assert d["mean"] == pytest.approx(5500.0)
    assert d["median"] == d["p50"] == pytest.approx(5500.0)
    assert d["p90"] == pytest.approx(9100.0)  # rank 0.9 * 9 = 8.1: 9 s + 0.1 * 1 s
    assert d["p99"] == pytest.approx(9910.0)
    assert d["std"] == pytest.approx(np.std(np.arange(1, 11)) * 1e3)
    assert distribution_ms([]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}


def test_attainment_counts_failures_as_misses_and_goodput_is_good_requests_per_second():
    records = [
        ok(ttft=0.2, e2el=1.0, output_len=9),  # TTFT 200 ms, TPOT 100 ms: meets both (limits are inclusive)
        ok(ttft=0.1, e2el=0.55, output_len=10),  # TPOT 50 ms
        ok(ttft=0.1, e2el=2.0, output_len=10),  # TPOT 211 ms: misses TPOT
        ok(ttft=0.5, e2el=0.9, output_len=5),  # misses TTFT
        failed(),
    ]
    slo = SLO(ttft_ms=200.0, tpot_ms=100.0)
    assert [meets_slo(r, slo) for r in records] == [True, True, False, False, False]
    s = summarize(records, duration_s=4.0, slo=slo)
    assert s["num_requests"] == 5 and s["completed"] == 4 and s["failed"] == 1
    assert s["failures_by_code"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["num_good"] == 2
    assert s["slo_attainment_pct"] == pytest.approx(40.0)
    assert s["goodput"] == pytest.approx(0.5)
    assert s["request_throughput"] == pytest.approx(1.0)  # completed / duration
    assert s["total_output_tokens"] == 34 and s["output_throughput"] == pytest.approx(34 / 4)
    assert s["ttft_ms"]["median"] == pytest.approx(150.0)  # failures are left out of latencies


def test_without_an_slo_every_successful_request_is_good():
    s = summarize([ok(0.1, 1.0, 5), failed()], duration_s=2.0)
    assert s["num_good"] == 1 and s["slo_attainment_pct"] == 50.0 and s["goodput"] == 0.5
    assert summarize([], duration_s=0.0)["slo_attainment_pct"] == 0.0


def test_parse_slo_accepts_ours_and_vllms_syntax():
    assert parse_slo("ttft_ms=500,tpot_ms=100") == SLO(ttft_ms=500.0, tpot_ms=100.0)
    assert parse_slo("ttft:500 tpot:100") == SLO(ttft_ms=500.0, tpot_ms=100.0)
    assert parse_slo(None) == SLO() and parse_slo("") == SLO() and parse_slo("tpot_ms=20") == SLO(tpot_ms=20.0)
    for bad in ("ttft_ms", "itl_ms=5", "e2el_ms=9000", "ttft_ms=-1", "ttft_ms=abc", "ttft_ms=0"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_rows_round_trip_exactly_to_the_microsecond(tmp_path):
    import csv

    from disagg.bench.metrics import ROW_FIELDS

    records = [ok(0.123456, 1.234567, 3, itl=[0.5, 0.611111]), failed("UNAVAILABLE")]
    path = tmp_path / "rows.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, ROW_FIELDS)
        writer.writeheader()
        writer.writerows(record_row(r) for r in records)
    back = read_rows(str(path))
    assert [(r.success, r.output_len, r.ttft, r.e2el, r.itl, r.error_code) for r in back] == [
        (True, 3, 0.123456, 1.234567, [0.5, 0.611111], ""),
        (False, 0, 0.0, 0.01, [], "UNAVAILABLE"),
    ]


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    load = LoadConfig(request_rate=4.0, num_requests=4000, seed=7)
    times = arrival_times(load)
    assert times == arrival_times(load) and times != arrival_times(
        LoadConfig(request_rate=4.0, num_requests=4000, seed=8)
    )
    assert times[0] == 0.0 and len(times) == 4000
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)  # exponential: CV 1


def test_gamma_burstiness_keeps_the_rate_and_changes_the_spread():
    bursty = np.diff(arrival_times(LoadConfig(request_rate=2.0, burstiness=0.25, num_requests=4000, seed=1)))
    regular = np.diff(arrival_times(LoadConfig(request_rate=2.0, burstiness=4.0, num_requests=4000, seed=1)))
    for gaps in (bursty, regular):
        assert gaps.mean() == pytest.approx(0.5, rel=0.1)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.15)  # CV = 1/sqrt(burstiness)
    assert regular.std() / regular.mean() == pytest.approx(0.5, rel=0.15)


def test_duration_and_infinite_rate_schedules():
    times = arrival_times(LoadConfig(request_rate=10.0, num_requests=None, duration_s=30.0, seed=0))
    assert all(t < 30.0 for t in times) and 240 < len(times) < 360
    assert arrival_times(LoadConfig(num_requests=5)) == [0.0] * 5
    for bad in (
        dict(num_requests=None),
        dict(num_requests=5, duration_s=3.0, request_rate=1.0),
        dict(request_rate=0.0),
        dict(max_concurrency=0),
        dict(num_requests=None, duration_s=3.0, request_rate=math.inf),
    ):
        with pytest.raises(ValueError):
            LoadConfig(**bad)


def test_median_ci_covers_the_true_median_and_narrows_with_more_samples():
    rng = np.random.default_rng(3)
    small, large = rng.normal(4.0, 10.0, 32), rng.normal(4.0, 10.0, 512)
    lo_small, hi_small = median_ci([small.tolist()])
    lo_large, hi_large = median_ci([large.tolist()])
    assert lo_small <= np.median(small) <= hi_small and lo_large < 4.0 < hi_large
    assert (hi_large - lo_large) < (hi_small - lo_small) / 2  # about 1/sqrt(16) as wide
    assert median_ci([[2.0] * 10]) == (2.0, 2.0)
    for bad in (dict(runs=[]), dict(runs=[[1.0], []]), dict(runs=[[1.0]], confidence=1.0)):
        with pytest.raises(ValueError):
            median_ci(**bad)


def test_median_ci_widens_with_what_differs_between_runs():
    rng = np.random.default_rng(4)
    same = [rng.normal(0.0, 5.0, 64).tolist() for _ in range(4)]
    shifted = [(np.asarray(r) + offset).tolist() for r, offset in zip(same, (-6.0, -2.0, 2.0, 6.0))]
    pooled = [sum(shifted, [])]  # the same values, as if from one run
    lo_runs, hi_runs = median_ci(shifted, resamples=1000)
    lo_pooled, hi_pooled = median_ci(pooled, resamples=1000)
    assert hi_runs - lo_runs > 1.5 * (hi_pooled - lo_pooled)


def test_median_difference_ci_keeps_each_request_with_its_pair():
    rng = np.random.default_rng(5)
    # Half the requests short, half long, the same on both sides but for a 3.0 shift. Each
    # resample's median falls among the short or the long ones; kept in pairs, both sides' do
    # alike, and the interval is about the shift. Split, it would span the gap between them.
    runs_a = [rng.permutation(np.repeat([50.0, 180.0], 32)) + rng.normal(0.0, 1.0, 64) for _ in range(3)]
    runs_b = [a + 3.0 + rng.normal(0.0, 1.0, a.size) for a in runs_a]
    lo, hi = median_difference_ci([a.tolist() for a in runs_a], [b.tolist() for b in runs_b], resamples=1000)
    assert lo < 3.0 < hi and hi - lo < 4.0
    for bad in (dict(runs_a=[[1.0]], runs_b=[]), dict(runs_a=[[1.0, 2.0]], runs_b=[[1.0]])):
        with pytest.raises(ValueError):
            median_difference_ci(**bad)


def test_attainment_crossing_interpolates_between_the_rates_around_it():
    from disagg.bench.metrics import attainment_crossing

    # 100% at 1 req/s, 80% at 2: 90% is half way
    assert attainment_crossing([(2.0, 80.0), (1.0, 100.0)]) == {"first_rate_below": 2.0, "crossing": 1.5}
    # from 95% at 1 to 70% at 1.5 (a drop of 25 points): 90% at 1 + 0.5 * 5 / 25 = 1.1
    assert attainment_crossing([(1.0, 95.0), (1.5, 70.0), (2.0, 90.0)])["crossing"] == pytest.approx(1.1)
    assert attainment_crossing([(1.0, 85.0), (2.0, 50.0)]) == {"first_rate_below": 1.0, "crossing": None}
    assert attainment_crossing([(1.0, 100.0), (2.0, 90.0)]) == {"first_rate_below": None, "crossing": None}
