"""Prometheus metrics: exact vLLM-style names, values that move, no shared state, /metrics over HTTP."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from disagg.metrics import ServingMetrics

HISTOGRAMS = [
    "disagg:time_to_first_token_seconds",
    "disagg:inter_token_latency_seconds",
    "disagg:e2e_request_latency_seconds",
    "disagg:request_queue_time_seconds",
    "disagg:request_prefill_time_seconds",
    "disagg:request_decode_time_seconds",
    "disagg:kv_transfer_seconds",
]
COUNTERS = [
    "disagg:kv_transfer_bytes_total",
    "disagg:request_success_total",
    "disagg:prompt_tokens_total",
    "disagg:generation_tokens_total",
    "disagg:request_failure_total",
]
GAUGES = ["disagg:kv_cache_usage_perc", "disagg:num_requests_running", "disagg:num_requests_waiting"]


def _observe_one(metrics: ServingMetrics) -> None:
    metrics.observe_finished(
        ttft_s=0.12, e2e_s=1.5, itl_s=[0.02, 0.03, 0.04], queue_s=0.01, prefill_s=0.1, decode_s=1.38,
        prompt_tokens=20, completion_tokens=4, finish_reason="stop",
    )  # fmt: skip


def _exposed_types(text: str) -> dict[str, str]:
    """Name -> type from the `# TYPE` lines of a text exposition, with counters' `_total` as rendered."""
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
    return types


def _sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_names_render_exactly_as_listed():
    metrics = ServingMetrics()
    _observe_one(metrics)
    metrics.observe_transfer(0.005, 1 << 20)
    metrics.observe_failure("UNAVAILABLE")
    metrics.set_instance_load("p0", "prefill", running=1, waiting=2, kv_usage=0.25)
    text = metrics.render().decode()
    types, samples = _exposed_types(text), _sample_names(text)
    for name in HISTOGRAMS:
        assert types[name] == "histogram"
        assert {f"{name}_bucket", f"{name}_sum", f"{name}_count"} <= samples
    for name in COUNTERS:
        assert types[name] == "counter", name
        assert name in samples
        assert f"{name}_total" not in samples  # never a doubled suffix
    for name in GAUGES:
        assert types[name] == "gauge"
        assert name in samples
    assert 'disagg:kv_cache_usage_perc{instance="p0",role="prefill"} 0.25' in text


def test_observations_change_values():
    metrics = ServingMetrics()
    value = metrics.registry.get_sample_value
    _observe_one(metrics)
    _observe_one(metrics)
    assert value("disagg:time_to_first_token_seconds_count") == 2
    assert value("disagg:time_to_first_token_seconds_sum") == pytest.approx(0.24)
    assert value("disagg:inter_token_latency_seconds_count") == 6
    assert value("disagg:e2e_request_latency_seconds_sum") == pytest.approx(3.0)
    assert value("disagg:request_queue_time_seconds_count") == 2
    assert value("disagg:request_prefill_time_seconds_count") == 2
    assert value("disagg:request_decode_time_seconds_sum") == pytest.approx(2.76)
    assert value("disagg:prompt_tokens_total") == 40
    assert value("disagg:generation_tokens_total") == 8
    assert value("disagg:request_success_total", {"finish_reason": "stop"}) == 2

    metrics.observe_transfer(0.5, 1000)
    metrics.observe_transfer(0.25, 24)
    assert value("disagg:kv_transfer_seconds_count") == 2
    assert value("disagg:kv_transfer_seconds_sum") == pytest.approx(0.75)
    assert value("disagg:kv_transfer_bytes_total") == 1024

    metrics.observe_failure("RESOURCE_EXHAUSTED")
    assert value("disagg:request_failure_total", {"code": "RESOURCE_EXHAUSTED"}) == 1

    labels = {"instance": "d0", "role": "decode"}
    metrics.set_instance_load("d0", "decode", running=7, waiting=3, kv_usage=0.5)
    metrics.set_instance_load("d0", "decode", running=8, waiting=0, kv_usage=0.75)
    assert value("disagg:num_requests_running", labels) == 8
    assert value("disagg:num_requests_waiting", labels) == 0
    assert value("disagg:kv_cache_usage_perc", labels) == 0.75
    metrics.remove_instance("d0", "decode")
    metrics.remove_instance("d0", "decode")  # twice is fine
    assert value("disagg:num_requests_running", labels) is None
    assert "d0" not in metrics.render().decode()


def test_two_instances_in_one_process_do_not_clash():
    first, second = ServingMetrics(), ServingMetrics(CollectorRegistry())
    _observe_one(first)
    assert first.registry.get_sample_value("disagg:time_to_first_token_seconds_count") == 1
    assert second.registry.get_sample_value("disagg:time_to_first_token_seconds_count") == 0


def test_http_server_serves_metrics_on_a_free_port():
    metrics = ServingMetrics()
    _observe_one(metrics)
    with metrics.start_http_server(0) as server:
        assert server.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as response:
            body = response.read().decode()
    assert "disagg:time_to_first_token_seconds_count 1.0" in body
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)  # stopped: the port no longer answers


def test_a_frontend_shows_the_controllers_replan_families_as_they_were_and_no_others():
    controller, frontend = ServingMetrics(), ServingMetrics(replan=False)
    controller.observe_replan(True, 12.5)
    controller.observe_switch("done", 1.5)
    controller.control_loop_failed("replanning")  # the controller's own loops: not mirrored
    frontend.controller_metrics.set(controller.replan_families())
    text = frontend.render().decode()
    assert 'disagg:replan_decisions_total{switch="true"} 1.0' in text
    assert "disagg:replan_predicted_gain_points 12.5" in text
    assert "disagg:replan_switch_seconds_count 1.0" in text
    assert 'loop="replanning"' not in text
    assert text.count("# TYPE disagg:replan_switches_total counter") == 1
