"""The planner's search on a toy profile whose optimum is known by construction."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disagg.placement.latency_model import Coefficients, StepModel
from disagg.placement.profile import Profile
from disagg.planner.hardware import hardware_spec
from disagg.planner.models import model_spec
from disagg.planner.search import NodeKind, PhaseOption, Search
from disagg.planner.segments import SegmentUnit, node_ratios
from disagg.planner.workload import SimRequest
from disagg.slo import SLO


def step(prefill_per_token: float, decode_ms: float, decode_ms_per_request: float = 3.0) -> StepModel:
    return StepModel(
        prefill=Coefficients(2.0, prefill_per_token, 0.0),
        decode_small=Coefficients(decode_ms, 0.0, decode_ms_per_request),
        decode_large=Coefficients(decode_ms, 0.0, decode_ms_per_request),
    )


# TP 1 decodes too slowly for a 200 ms TPOT; TP 2 decodes fast but prefills only 10% faster, so the
# best prefill per device is TP 1 and the only decode that meets the SLO is TP 2. A decode step
# grows with its batch, so a decode instance's rate has a ceiling (one without would be searched up
# to thousands of requests a second, each run simulated whole: tens of seconds for nothing).
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
    assert search.holds(search.simulate(pools, kind.hardware.kv_transfer(), rate))
    assert not search.holds(search.simulate(pools, kind.hardware.kv_transfer(), rate * 1.5))


def test_bad_clusters_and_slos_are_refused():
    from disagg.planner_cli.plan_cli import _parse_cluster

    with pytest.raises(ValueError):
        _parse_cluster("4by8", "a100-80gb")
    with pytest.raises(ValueError):
        _parse_cluster("4x8", None)
    assert _parse_cluster("4x8", "h100-sxm") == [("h100-sxm", 4, 8)]


# ---- Algorithm 2: instance segments --------------------------------------------------------------
def segment_search(num_nodes: int, devices_per_node: int) -> Search:
    search = toy_search()
    kind = NodeKind(hardware_spec("a100-80gb"), TOY, num_nodes=num_nodes, devices_per_node=devices_per_node)
    return replace(search, kinds=[kind])


def test_segments_that_overflow_a_node_are_never_an_algorithm_2_candidate():
    search = segment_search(num_nodes=4, devices_per_node=2)
    kind = search.kinds[0]
    tp1, tp2 = PhaseOption(1, 1, kind, 5.0), PhaseOption(2, 1, kind, 5.0)
    pairs = {(p.tp, d.tp) for p, d in search.segment_pairs([tp1, tp2], [tp1, tp2])}
    assert pairs == {(1, 1)}, "TP 1 + TP 2 (or TP 2 + anything) does not fit a 2-device node"
    other_pp = PhaseOption(1, 2, kind, 5.0)
    assert search.segment_pairs([tp1], [other_pp]) == [], "a stage's segments hold the same layers"


def test_segments_that_fit_a_node_are_a_candidate_sized_together():
    search = segment_search(num_nodes=1, devices_per_node=4)
    candidates = search.low_affinity(None, progress=lambda _: None)
    assert candidates and all(c.algorithm == "distserve-alg2" for c in candidates)
    assert all(c.pools["prefill"].tp + c.pools["decode"].tp <= 4 for c in candidates)
    best = candidates[0]
    prefill, decode = best.pools["prefill"], best.pools["decode"]
    assert (prefill.tp, decode.tp) == (1, 2) and best.max_rate > 0
    assert prefill.instances * prefill.tp + decode.instances * decode.tp <= 4, "one node's segments"
    assert best.notes["nodes"] == 1


def test_algorithm_2_never_needs_more_nodes_than_the_cluster_has():
    search = segment_search(num_nodes=2, devices_per_node=4)
    kind = search.kinds[0]
    prefill, decode = PhaseOption(1, 1, kind, 1.75), PhaseOption(2, 1, kind, 1280.0)  # the toy's phases alone
    unit = search.segment_candidate(prefill, decode, None)
    assert unit.notes["nodes"] == 1 and unit.max_rate > 0
    provisioned = search.segment_candidate(prefill, decode, 1.5 * unit.max_rate)
    assert provisioned.notes == {**unit.notes, "replicas": 2, "nodes": 2}
    assert provisioned.devices == 2 * unit.devices <= 8
    # a rate that needs more nodes than there are is no candidate, not a plan the cluster cannot hold
    assert search.segment_candidate(prefill, decode, 2.5 * unit.max_rate) is None


def test_segment_units_count_nodes_by_stage_slots():
    unit = SegmentUnit(pp=2, prefill_tp=2, decode_tp=1, num_prefill=1, num_decode=2)  # 4 devices a stage
    assert unit.devices == 8 and unit.stages_per_node(8) == 2
    assert unit.nodes_needed(3, 8) == 3  # 6 stage slots, 2 a node
    assert unit.max_replicas(3, 8) == 3
    assert not SegmentUnit(1, 4, 8).fits_node(8) and SegmentUnit(1, 4, 4).fits_node(8)
    assert SegmentUnit(1, 4, 8).max_replicas(10, 8) == 0
    assert node_ratios(2, 1, 4) == [(1, 1), (1, 2)], "coprime ratios whose segments fit 4 devices"
