"""One factory from a serving config to its placement policy, and everything that simulates a
config (Deployment, the planner's search) running the policy that config would run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import disagg.planner.search as search_module
from disagg.config import PLACEMENTS, ServingConfig
from disagg.placement.factory import PLACEMENT_POLICIES, placement_policy
from disagg.placement.goodput import GoodputPolicy
from disagg.placement.latency_model import Coefficients, StepModel
from disagg.placement.policies import LeastOutstandingWork
from disagg.slo import SLO
from disagg.placement.profile import Profile
from disagg.planner.deployment import Deployment, trace_config
from disagg.planner.hardware import hardware_spec
from disagg.planner.models import model_spec
from disagg.planner.search import NodeKind, Search
from disagg.planner.simulator import Simulator
from disagg.planner.workload import SimRequest

# prefill: 10 ms + 1 ms per token; decode: 5 ms + 2 ms per request in the batch
MODEL = StepModel(
    prefill=Coefficients(10.0, 1.0, 0.0),
    decode_small=Coefficients(5.0, 0.0, 2.0),
    decode_large=Coefficients(5.0, 0.0, 2.0),
)
PROFILE = Profile(
    model="llama2-7b", hardware="a100-80gb", source="measured", entries={(1, 1): MODEL}, kv_bytes_per_token=1000
)


def config(**settings) -> ServingConfig:
    return ServingConfig.from_dict({"engine": {"num_kv_blocks": 1000}, **settings})


# ---- the factory ---------------------------------------------------------------------------------
def test_every_placement_the_config_accepts_has_a_policy():
    assert set(PLACEMENT_POLICIES) == set(PLACEMENTS)


def test_goodput_is_built_with_the_configs_admission_settings():
    policy = placement_policy(config(local_prefill_max_tokens=64))
    assert type(policy) is GoodputPolicy
    assert (policy.best_effort, policy.local_prefill_max_tokens) == (False, 64)
    assert placement_policy(config(slo_admission="best_effort")).best_effort


def test_least_work_is_built_for_least_work():
    assert type(placement_policy(config(placement="least_work"))) is LeastOutstandingWork


def test_an_unknown_placement_is_a_value_error_naming_the_known_ones():
    with pytest.raises(ValueError, match="round_robin.*goodput, least_work"):
        placement_policy(SimpleNamespace(placement="round_robin"))


# ---- what simulates a config runs the config's policy -----------------------------------------------
def _overloaded(deployment_config: ServingConfig) -> list:
    deployment = Deployment(deployment_config, {"prefill": PROFILE, "decode": PROFILE})
    # each prompt takes 110 ms of the one prefill instance: 20 req/s is twice what it can do
    return deployment.simulator().run([SimRequest(i, i * 0.05, 100, 10) for i in range(200)])


def test_a_goodput_deployment_refuses_under_overload_and_a_least_work_one_queues_everything():
    slo = {"ttft_ms": 500.0, "tpot_ms": 100.0}
    unbounded = {"max_inflight_requests": 10_000}  # only the policy refuses
    goodput = _overloaded(config(slo=slo, **unbounded))
    least_work = _overloaded(config(slo=slo, placement="least_work", **unbounded))
    refused = [r for r in goodput if r.failed]
    assert 80 <= len(refused) <= 120 and {r.error_code for r in refused} == {"RESOURCE_EXHAUSTED"}
    assert not any(r.failed for r in least_work)


def test_a_deployment_given_a_policy_runs_that_one():
    policy = LeastOutstandingWork()
    assert Deployment(config(), {"prefill": PROFILE, "decode": PROFILE}, policy=policy).simulator().policy is policy


def test_replays_of_other_systems_queue_everything():
    for recorded in ({"mode": "disaggregated"}, {"mode": "colocated", "scheduler": "vllm"}):
        assert trace_config(recorded, "llama2-7b").placement == "least_work"


def test_the_search_simulates_the_policy_and_slo_the_config_it_writes_runs(monkeypatch):
    built: list[Simulator] = []

    class Recording(Simulator):
        def __post_init__(self) -> None:
            super().__post_init__()
            built.append(self)

    monkeypatch.setattr(search_module, "Simulator", Recording)
    kind = NodeKind(hardware_spec("a100-80gb"), PROFILE, num_nodes=1, devices_per_node=2)
    requests = [SimRequest(i, 0.0, 100, 10) for i in range(30)]
    search = Search(model_spec("llama2-7b"), [kind], requests, SLO(500.0, 100.0), min_duration_s=5.0)
    pools = [search.pool("prefill", kind, 1, 1), search.pool("decode", kind, 1, 1)]
    records = search.simulate(pools, kind.hardware.kv_transfer(), rate=20.0)  # twice the prefill's rate
    assert type(built[0].policy) is GoodputPolicy and not built[0].policy.best_effort
    assert built[0].slo == SLO(500.0, 100.0)
    assert any(r.error_code == "RESOURCE_EXHAUSTED" for r in records)
