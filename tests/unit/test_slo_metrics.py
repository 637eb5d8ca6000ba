"""SLO attainment and goodput as metrics: a finished request judged against both targets, and
the gauges over the last minute per SLO class (pure: no server)."""

from __future__ import annotations

import prometheus_client
import pytest

from disagg.metrics import SLO_WINDOW_S, ServingMetrics
from disagg.slo import SLO
from disagg.router.request_path import meets_slo
from disagg.router.stream_stats import Outcome


def outcome(ttft_s: float, e2e_s: float, tokens: int) -> Outcome:
    return Outcome("length", 10, tokens, 0, 0.0, 0.0, 0.0, 0, 0.0, ttft_s, e2e_s, (), "p", "d", 0.0, 0.0)


def test_a_request_meets_its_slo_only_within_both_targets():
    slo = SLO(ttft_ms=500, tpot_ms=50)
    assert meets_slo(outcome(0.4, 0.4 + 9 * 0.045, 10), slo)
    assert not meets_slo(outcome(0.6, 0.6 + 9 * 0.045, 10), slo)  # TTFT over
    assert not meets_slo(outcome(0.4, 0.4 + 9 * 0.055, 10), slo)  # TPOT over
    assert meets_slo(outcome(5.0, 50.0, 10), SLO(0, 0))  # no targets: nothing to miss
    assert meets_slo(outcome(0.4, 0.4, 1), slo)  # one token: no TPOT


def gauges(metrics: ServingMetrics) -> dict[str, float]:
    text = prometheus_client.generate_latest(metrics.registry).decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("disagg:slo_attainment_ratio", "disagg:goodput_requests_per_second"))
    }


def test_attainment_and_goodput_per_class_over_the_last_minute():
    m = ServingMetrics()
    for t, met in [(0, True), (1, True), (2, False), (3, True)]:
        m.observe_slo("standard", met, now=t)
    m.observe_slo("critical", False, now=4)
    g = gauges(m)
    assert g['disagg:slo_attainment_ratio{slo_class="standard"}'] == pytest.approx(0.75)
    assert g['disagg:goodput_requests_per_second{slo_class="standard"}'] == pytest.approx(3 / SLO_WINDOW_S)
    assert g['disagg:slo_attainment_ratio{slo_class="critical"}'] == 0.0
    m.refresh_slo_window(now=2.5 + SLO_WINDOW_S)  # the first three are out of the window
    g = gauges(m)
    assert g['disagg:slo_attainment_ratio{slo_class="standard"}'] == 1.0
    assert g['disagg:goodput_requests_per_second{slo_class="standard"}'] == pytest.approx(1 / SLO_WINDOW_S)
