"""Plans for the whole of one host: candidates replicated over its devices and simulated whole,
and the serving config each becomes on a 2-core machine."""

from __future__ import annotations

import pytest

from disagg.placement.latency_model import Coefficients, HostSharing, StepModel
from disagg.placement.profile import Profile
from disagg.planner.hardware import hardware_spec
from disagg.planner.host_plan import host_plans, on_host, replicas_on_host, replicated_pools
from disagg.planner.models import model_spec
from disagg.planner.plan_config import serving_config_dict
from disagg.planner.search import Candidate, NodeKind, PoolPlan, Search
from disagg.planner.workload import SimRequest
from disagg.slo import SLO

# prefill: 10 ms + 1 ms per token; decode: 20 ms a step whatever the batch
STEP = StepModel(Coefficients(10.0, 1.0, 0.0), Coefficients(20.0, 0.0, 0.0), Coefficients(20.0, 0.0, 0.0))
MODEL = "smollm2-135m-instruct"


def search(hardware: str, devices: int, sharing: HostSharing = HostSharing()) -> Search:
    profile = Profile(MODEL, hardware, "measured", {(1, 1): STEP}, kv_bytes_per_token=46080, host_sharing=sharing)
    kind = NodeKind(hardware_spec(hardware), profile, num_nodes=1, devices_per_node=devices)
    requests = [SimRequest(i, 0.0, 100, 10) for i in range(40)]
    slo = SLO(ttft_ms=1000.0, tpot_ms=100.0)
    return Search(model_spec(MODEL), [kind], requests, slo, min_duration_s=5.0, rate_tolerance=0.05)


def colocated(hardware: str, instances: int = 1, policy: str = "chunked") -> Candidate:
    return Candidate("colocated", {"colocated": PoolPlan(1, 1, instances, hardware, policy, 512)}, 1.0, "colocated")


def test_whole_copies_of_a_candidate_fill_the_host():
    assert replicas_on_host(colocated("cpu-1t"), 2) == 2
    disaggregated = Candidate(
        "disaggregated", {"prefill": PoolPlan(1, 1, 1, "cpu-1t"), "decode": PoolPlan(1, 1, 1, "cpu-1t")}, 1.0
    )
    assert replicas_on_host(disaggregated, 2) == 1
    assert replicas_on_host(disaggregated, 1) == 0


def test_replicas_keep_the_engine_settings():
    [pool] = replicated_pools(colocated("cpu-1t", policy="prefill_first"), 2)
    assert (pool.role, pool.instances) == ("colocated", 2)
    assert pool.engine == {"scheduling_policy": "prefill_first", "max_num_batched_tokens": 512}


def test_replicas_on_a_shared_host_do_not_add_up():
    # Alone, one instance sustains some rate r; two on separate devices about 2r. When each runs
    # at half speed while the other computes, two together do at most what one does alone (less
    # here: its decode steps cost the same whatever the batch, so one instance batching every
    # request beats two at half speed).
    alone = search("cpu-1t", 2).max_rate([search("cpu-1t", 2).pool("colocated", search("cpu-1t", 2).kinds[0], 1, 1)],
                                         hardware_spec("cpu-1t").kv_transfer())  # fmt: skip
    separate = on_host(search("cpu-1t", 2), colocated("cpu-1t")).rate
    shared = on_host(
        search("cpu-1t", 2, HostSharing({k: {"prefill": 2.0, "decode": 2.0} for k in ("prefill", "decode")})),
        colocated("cpu-1t"),
    ).rate
    assert separate == pytest.approx(2 * alone, rel=0.15)
    assert shared < 1.05 * alone


def test_a_plan_on_two_cores_becomes_the_config_the_server_runs_there():
    one_thread, two_threads = search("cpu-1t", 2), search("cpu-2t", 1)
    plans = host_plans([(one_thread, [colocated("cpu-1t")]), (two_threads, [colocated("cpu-2t")])])
    assert [p.rate for p in plans] == sorted((p.rate for p in plans), reverse=True)
    by_hardware = {p.hardware: p for p in plans}
    slo = SLO(ttft_ms=1000.0, tpot_ms=100.0)
    replicas = serving_config_dict(by_hardware["cpu-1t"].candidate, MODEL, slo, one_thread.kinds)
    assert replicas["colocated"]["num_instances"] == 2 and replicas["threads_per_worker"] == 1
    single = serving_config_dict(by_hardware["cpu-2t"].candidate, MODEL, slo, two_threads.kinds)
    assert single["colocated"]["num_instances"] == 1 and single["threads_per_worker"] == 2
    assert single["slo"] == slo.to_dict() and by_hardware["cpu-1t"].label == "colocated chunked/512 x2 cpu-1t"
