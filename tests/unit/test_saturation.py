"""The simulator at and past saturation: requests waiting for decode room in order, a run that
loses attainment as it lengthens, and other systems replayed as they run (their memory rule, their
decode admission, and their engines' served steps)."""

from __future__ import annotations


import pytest

from support import distserve_data

from disagg.placement.latency_model import Coefficients, StepModel
from disagg.placement.profile import load_profile
from disagg.planner import memory
from disagg.planner.deployment import trace_deployment
from disagg.planner.hardware import hardware_spec
from disagg.planner.models import model_spec
from disagg.planner.simulator import SimPool, Simulator, slo_attainment
from disagg.placement.published_profiles import FITTED, ServedStep
from disagg.planner.traced_systems import SYSTEMS, system_of
from disagg.planner.workload import SimRequest, load_trace
from disagg.slo import SLO, met

# prefill: 10 ms + 1 ms per token; decode: 5 ms + 2 ms per request in the batch
MODEL = StepModel(Coefficients(10.0, 1.0, 0.0), Coefficients(5.0, 0.0, 2.0), Coefficients(5.0, 0.0, 2.0))


def one_pair(decode_blocks: int, admission: str, max_num_seqs: int = 128) -> Simulator:
    pools = [
        SimPool("prefill", 1, MODEL, num_kv_blocks=10_000),
        SimPool("decode", 1, MODEL, num_kv_blocks=decode_blocks, max_num_seqs=max_num_seqs),
    ]
    return Simulator(pools, decode_admission=admission, admission_timeout_s=1e9)


def test_queued_requests_get_decode_room_in_their_order_and_none_is_lost():
    # each request needs 2 blocks for its prompt and a third as it decodes: the decode instance
    # holds one at a time, the others wait in the queue (their KV in the prefill's blocks)
    burst = [SimRequest(i, 0.001 * i, 20, 20) for i in range(6)]
    records = one_pair(decode_blocks=3, admission="queue").run(burst)
    assert all(r.success for r in records)
    finishes = [r.finish_s for r in records]
    assert finishes == sorted(finishes)  # first come, first served
    assert records[-1].tpot_s > 4 * records[0].tpot_s  # the last waited for all the others


def test_a_decode_side_past_its_capacity_loses_attainment_as_the_run_lengthens():
    # 20 req/s of 50-token outputs, 1,000 tokens/s, against a decode instance that runs 4 requests
    # at once, 4 tokens per 13 ms step (about 300 tokens/s): the queue grows all run long
    requests = [SimRequest(i, i * 0.05, 16, 50) for i in range(100)]
    records = one_pair(decode_blocks=1000, admission="queue", max_num_seqs=4).run(requests)
    assert all(r.success for r in records)
    first, last = records[:8], records[-50:]
    assert slo_attainment(first, SLO(tpot_ms=100)) >= 75 and slo_attainment(last, SLO(tpot_ms=100)) == 0
    assert all(b.tpot_s >= a.tpot_s - 1e-3 for a, b in zip(last, last[1:]))  # each waits longer


def test_an_unknown_decode_admission_is_refused():
    with pytest.raises(ValueError, match="decode_admission"):
        one_pair(decode_blocks=10, admission="lottery")


def test_a_served_step_adds_the_loop_time_to_every_decode_step_and_scales_the_prefill():
    served = ServedStep(prefill_scale=0.5, decode_per_step_ms=3.0, decode_per_request_ms=0.25).apply(MODEL)
    assert served.decode_ms(8, 1000) == pytest.approx(MODEL.decode_ms(8, 1000) + 3.0 + 8 * 0.25)
    assert served.prefill_ms([100]) == pytest.approx(MODEL.prefill_ms([100]) / 2)


def test_a_published_profile_loads_as_its_engine_serves_it():
    path = distserve_data("profiler-a100-80g.distserve.json")
    forward = load_profile(str(path), model="facebook/opt-13b", served=False)
    served = load_profile(str(path), model="facebook/opt-13b")
    fitted = FITTED["distserve"]
    assert forward.frontend_ms == 0 and served.frontend_ms == fitted.frontend_ms
    batch, context = 32, 32 * 900
    extra = fitted.decode_per_step_ms + batch * fitted.decode_per_request_ms
    assert served.step_model(1, 1).decode_ms(batch, context) == pytest.approx(
        forward.step_model(1, 1).decode_ms(batch, context) + extra
    )


def test_vllm_keeps_room_for_the_activations_of_its_trial_step():
    opt, a100 = model_spec("facebook/opt-13b"), hardware_spec("a100-80gb")
    plain = memory.kv_capacity_tokens(opt, a100, 1, 1, utilization=0.92)
    vllm = memory.kv_capacity_tokens(opt, a100, 1, 1, utilization=0.92, activation_tokens=65536)
    per_token = memory.kv_bytes_per_token_per_device(opt, 1, 1)
    assert plain - vllm == pytest.approx(memory.activation_bytes_per_device(opt, 65536, 1) / per_token, abs=1)
    # DistServe's own rule (92% less 1%, less the weights) gives its decode instance ~64K tokens
    distserve = SYSTEMS["distserve"]
    assert 62_000 < memory.kv_capacity_tokens(opt, a100, 1, 1, utilization=distserve.memory_utilization) < 66_000


def test_a_trace_names_its_system():
    assert system_of({"mode": "colocated", "scheduler": "vllm-0.2 (prefill-first)"}).name == "vllm"
    assert system_of({"mode": "disaggregated"}).name == "distserve"


# ---- DistServe's measured runs (tests.support.distserve_data: a failure under CI where they are missing) ----------------------------
def replay(name: str):
    trace = load_trace(str(distserve_data(name)))
    system = system_of(trace.config).name
    profile = load_profile(str(distserve_data(f"profiler-a100-80g.{system}.json")), model=trace.model)
    records = trace_deployment(trace.config, trace.model, profile).simulator().run(trace.requests)
    slo = trace.slo
    met_slo = [met(slo, m["ttft_ms"], m["tpot_ms"]) for m in trace.measured]
    return records, met_slo, slo


def test_distserve_loses_attainment_as_its_run_lengthens_at_the_same_rate_and_so_does_the_replay():
    # 300 requests at 6 req/s: 90.7% met; twice as long at the same rate: 60.7%
    short, short_met, slo = replay("distserve-c21d11-300-6.json")
    long, long_met, _ = replay("distserve-c21d11-600-6.json")
    attained = lambda records: slo_attainment(records, slo)  # noqa: E731
    assert abs(attained(short) - 100 * sum(short_met) / len(short_met)) <= 5
    assert abs(attained(long) - 100 * sum(long_met) / len(long_met)) <= 5
    assert attained(long[-150:]) < attained(long[:150]) - 40  # the decode side's queue grows
