"""The planner's search on a toy profile whose optimum is known by construction."""

from __future__ import annotations

import pytest

from disagg.placement.latency_model import Coefficients, StepModel
from disagg.placement.profile import Profile
from disagg.planner.hardware import hardware_spec
from disagg.planner.models import model_spec
from disagg.planner.search import SLO, NodeKind, Search
from disagg.planner.workload import SimRequest


def step(prefill_per_token: float, decode_ms: float) -> StepModel:
    return StepModel(
        prefill=Coefficients(2.0, prefill_per_token, 0.0),
        decode_small=Coefficients(decode_ms, 0.0, 0.0),
        decode_large=Coefficients(decode_ms, 0.0, 0.0),
    )


# TP 1 decodes too slowly for a 200 ms TPOT; TP 2 decodes fast but prefills only 10% faster, so the
# best prefill per device is TP 1 and the only decode that meets the SLO is TP 2.
TOY = Profile(
    model="llama2-7b",
    hardware="a100-80gb",
    source="measured",
    entries={(1, 1): step(10.0, 500.0), (2, 1): step(9.0, 50.0)},
    kv_bytes_per_token=1000,
    num_layers=32,
)


def toy_search(devices: int = 4) -> Search:
    kind = NodeKind(hardware_spec("a100-80gb"), TOY, num_nodes=1, devices_per_node=devices)
    requests = [SimRequest(i, 0.0, 50, 10) for i in range(30)]
    slo = SLO(ttft_ms=2000.0, tpot_ms=200.0)
    return Search(model_spec("llama2-7b"), [kind], requests, slo, min_duration_s=1.0, rate_tolerance=0.2)


def test_the_search_finds_the_known_optimum():
    candidates = toy_search().run()
    best = candidates[0]
    assert best.mode == "disaggregated"
    assert (best.pools["prefill"].tp, best.pools["decode"].tp) == (1, 2)
    assert best.devices <= 4 and best.max_rate > 0
    # colocated TP 1 cannot meet the TPOT at any rate
    colocated_tp1 = [c for c in candidates if c.mode == "colocated" and c.pools["colocated"].tp == 1]
    assert colocated_tp1 and all(c.max_rate == 0 for c in colocated_tp1)
    assert [c.goodput_per_device for c in candidates] == sorted(
        (c.goodput_per_device for c in candidates), reverse=True
    )


def test_a_target_rate_is_provisioned_with_replicas():
    candidates = toy_search().run(target_rate=50.0)
    best = candidates[0]
    assert best.max_rate >= 50.0 * 0.9


def test_the_max_rate_is_where_the_slo_starts_to_fail():
    search = toy_search()
    kind = search.kinds[0]
    pools = [search.pool("colocated", kind, 2, 1)]
    rate = search.max_rate(pools, kind.hardware.kv_transfer())
    assert rate > 0
    assert search.slo.met(search.simulate(pools, kind.hardware.kv_transfer(), rate))
    assert not search.slo.met(search.simulate(pools, kind.hardware.kv_transfer(), rate * 1.5))


def test_bad_clusters_and_slos_are_refused():
    from disagg.planner.plan_cli import _parse_cluster

    with pytest.raises(ValueError):
        _parse_cluster("4by8", "a100-80gb")
    with pytest.raises(ValueError):
        _parse_cluster("4x8", None)
    assert _parse_cluster("4x8", "h100-sxm") == [("h100-sxm", 4, 8)]
