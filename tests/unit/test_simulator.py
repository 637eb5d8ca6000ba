"""The simulator on cases that can be computed by hand: exact times, from the engine's own
scheduler and a latency model with round coefficients."""

from __future__ import annotations

import math

import pytest

from disagg.placement.latency_model import Coefficients, StepModel, TransferModel
from disagg.planner.simulator import SimPool, Simulator, percentile, slo_attainment
from disagg.slo import SLO
from disagg.planner.workload import SimRequest, poisson_arrivals

# prefill: 10 ms + 1 ms per token; decode: 5 ms + 2 ms per request in the batch (no context term)
MODEL = StepModel(
    prefill=Coefficients(10.0, 1.0, 0.0),
    decode_small=Coefficients(5.0, 0.0, 2.0),
    decode_large=Coefficients(5.0, 0.0, 2.0),
)


def colocated(**overrides) -> Simulator:
    pool = SimPool("colocated", 1, MODEL, num_kv_blocks=1000, **overrides)
    return Simulator([pool])


def disaggregated(transfer: TransferModel, kv_bytes_per_token: int = 0) -> Simulator:
    pools = [SimPool("prefill", 1, MODEL, num_kv_blocks=1000), SimPool("decode", 1, MODEL, num_kv_blocks=1000)]
    return Simulator(pools, transfer=transfer, kv_bytes_per_token=kv_bytes_per_token, num_layers=1)


def test_one_request_colocated():
    [r] = colocated().run([SimRequest(0, 0.0, 20, 4)])
    assert r.ttft_s * 1e3 == pytest.approx(30.0)  # 10 + 20 * 1
    # 3 decode steps of one request: 5 + 2 each
    assert r.e2el_s * 1e3 == pytest.approx(30.0 + 3 * 7.0)
    assert r.tpot_s * 1e3 == pytest.approx(7.0)


def test_a_known_batch_shares_its_steps():
    records = colocated().run([SimRequest(0, 0.0, 10, 3), SimRequest(1, 0.0, 20, 5)])
    # one prefill step of both prompts: 10 + 30
    assert [r.ttft_s * 1e3 for r in records] == pytest.approx([40.0, 40.0])
    # two decode steps of both (5 + 2*2 = 9 each), then request 1 alone for two more (7 each)
    assert records[0].e2el_s * 1e3 == pytest.approx(40.0 + 2 * 9.0)
    assert records[1].e2el_s * 1e3 == pytest.approx(40.0 + 2 * 9.0 + 2 * 7.0)


def test_the_token_budget_chunks_a_long_prompt():
    [r] = colocated(max_num_batched_tokens=16).run([SimRequest(0, 0.0, 40, 2)])
    # chunks of 16, 16 and 8 tokens: (10 + 16) + (10 + 16) + (10 + 8)
    assert r.ttft_s * 1e3 == pytest.approx(70.0)


def test_a_request_arriving_during_a_run_of_decodes_waits_for_the_step_under_way():
    first, second = colocated().run([SimRequest(0, 0.0, 10, 100), SimRequest(1, 0.050, 10, 2)])
    # request 0: prefill 0-20 ms, then decode steps of 7 ms: ends at 20 + 7k; 50 ms falls in
    # the step 48-55, so request 1 is scheduled at 55 ms, with request 0's decode in the same step
    # (sum of parts, one shared intercept: prefill 10 + 10 tokens, plus decode 5 + 2 - 5).
    assert second.ttft_s * 1e3 == pytest.approx(55.0 + 22.0 - 50.0)
    assert first.success and first.output_len == 100


def test_disaggregated_adds_the_transfer_between_prefill_and_decode():
    # 1 MB/s, 1 byte per token: a 20-token prompt moves in 20 ms, plus 3 ms latency, and with
    # one layer nothing overlaps the prefill step.
    transfer = TransferModel(bandwidth_bytes_per_s=1000.0, latency_ms=3.0)
    [r] = disaggregated(transfer, kv_bytes_per_token=1).run([SimRequest(0, 0.0, 20, 4)])
    assert r.ttft_s * 1e3 == pytest.approx(30.0)
    assert r.e2el_s * 1e3 == pytest.approx(30.0 + 23.0 + 3 * 7.0)
    assert r.prefill_instance == "prefill-0" and r.decode_instance == "decode-0"


def test_layerwise_streaming_hides_the_transfer_behind_the_prefill():
    transfer = TransferModel(bandwidth_bytes_per_s=1e9, latency_ms=0.0)
    fast = TransferModel(bandwidth_bytes_per_s=math.inf)
    slow_link = transfer.wait_after_prefill_ms(num_bytes=1e6, prefill_ms=100.0, num_layers=10)
    assert slow_link == pytest.approx(0.1)  # 1 ms on the wire, 9/10 of it during the prefill
    assert fast.transfer_ms(1e9) == 0.0


def test_kv_transfers_queue_on_the_prefill_instance_link():
    # two 20-token prompts prefilled in one step (10 + 40 = 50 ms), 1 byte per token at 1 kB/s:
    # 20 ms each on the wire, one layer (nothing overlaps the step): the second waits for the first
    transfer = TransferModel(bandwidth_bytes_per_s=1000.0, latency_ms=0.0)
    pools = [
        SimPool("prefill", 1, MODEL, num_kv_blocks=1000, scheduling_policy="prefill_first"),
        SimPool("decode", 1, MODEL, num_kv_blocks=1000),
    ]
    sim = Simulator(pools, transfer=transfer, kv_bytes_per_token=1, num_layers=1)
    first, second = sim.run([SimRequest(0, 0.0, 20, 2), SimRequest(1, 0.0, 20, 2)])
    assert first.ttft_s == second.ttft_s == pytest.approx(0.05)
    # KV at 70 and 90 ms; each then decodes one token in a step of its own (5 + 2 ms)
    assert first.finish_s * 1e3 == pytest.approx(70.0 + 7.0)
    assert second.finish_s * 1e3 == pytest.approx(90.0 + 7.0)


def test_requests_beyond_the_kv_capacity_wait_and_none_is_lost():
    pool = SimPool("colocated", 1, MODEL, num_kv_blocks=4, block_size=16)
    records = Simulator([pool]).run([SimRequest(i, 0.0, 30, 10) for i in range(3)])
    assert all(r.success for r in records)  # 2 blocks each after growth: one at a time, with preemptions
    assert max(r.e2el_s for r in records) > 2 * min(r.e2el_s for r in records)


def test_a_decode_pool_without_room_fails_requests_after_the_admission_timeout():
    # request 0 reserves 13 of the decode instance's 15 blocks for ~0.45 s; request 1 needs 3
    pools = [SimPool("prefill", 1, MODEL, num_kv_blocks=100), SimPool("decode", 1, MODEL, num_kv_blocks=15)]
    sim = Simulator(pools, admission_timeout_s=0.1)
    records = sim.run([SimRequest(0, 0.0, 200, 30), SimRequest(1, 0.001, 40, 5)])
    assert records[0].success
    assert not records[1].success and "admission timeout" in records[1].failed
    assert records[1].error_code == "RESOURCE_EXHAUSTED"
    assert slo_attainment(records) == 50.0


def test_requests_arriving_beyond_the_inflight_limit_are_refused_at_once_and_later_ones_admitted():
    pool = SimPool("colocated", 1, MODEL, num_kv_blocks=1000)
    burst = [SimRequest(i, 0.0, 10, 5) for i in range(5)] + [SimRequest(5, 1.0, 10, 5)]
    records = Simulator([pool], max_inflight=3).run(burst)
    assert [r.success for r in records] == [True, True, True, False, False, True]
    assert records[3].failed == "refused: 3 requests in flight"
    assert records[3].error_code == "RESOURCE_EXHAUSTED"  # what the server answers
    assert all(r.success for r in Simulator([pool]).run(burst))  # no limit: all six run


def test_placement_spreads_requests_over_instances():
    pool = SimPool("colocated", 2, MODEL, num_kv_blocks=1000)
    records = Simulator([pool]).run([SimRequest(0, 0.0, 10, 50), SimRequest(1, 0.001, 10, 50)])
    assert {r.decode_instance for r in records} == {"colocated-0", "colocated-1"}


def test_prefill_first_stalls_decodes_while_a_prompt_runs():
    requests = [SimRequest(0, 0.0, 10, 50), SimRequest(1, 0.030, 100, 2)]
    chunked = colocated(max_num_batched_tokens=64).run(requests)
    prefill_first = colocated(max_num_batched_tokens=64, scheduling_policy="prefill_first").run(requests)
    # prefill-first runs the whole 100-token prompt in one step, chunked splits it under the budget
    assert prefill_first[1].ttft_s < chunked[1].ttft_s
    assert prefill_first[0].tpot_s > chunked[0].tpot_s * 0 + 7.0 / 1e3  # the stall lengthened a gap


def test_attainment_and_percentiles():
    records = colocated().run([SimRequest(0, 0.0, 20, 4), SimRequest(1, 10.0, 200, 4)])
    assert slo_attainment(records, SLO(ttft_ms=100)) == 50.0  # 30 ms and 210 ms
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, math.inf], 90) == math.inf


def test_many_requests_are_simulated_in_order_of_arrival_and_all_complete():
    times = poisson_arrivals(2000, rate=20.0, seed=1)
    requests = [SimRequest(i, t, 50 + i % 300, 2 + i % 60) for i, t in enumerate(times)]
    records = colocated(max_num_batched_tokens=512).run(requests)
    assert all(r.success for r in records)
    assert [r.index for r in records] == list(range(2000))
    assert all(r.first_token_s >= r.arrival_s for r in records)


def test_a_request_that_can_never_fit_is_refused_as_the_router_would():
    [r] = colocated(max_model_len=64).run([SimRequest(0, 0.0, 60, 10)])
    assert not r.success and r.failed.startswith("invalid") and r.error_code == "INVALID_ARGUMENT"


def test_bad_pools_are_refused():
    with pytest.raises(ValueError):
        Simulator([SimPool("prefill", 1, MODEL, num_kv_blocks=10)])
    with pytest.raises(ValueError):
        SimRequest(0, 0.0, 0, 5)


# ---- the goodput-aware policy, run by the simulator ----------------------------------------------
def _overloaded(policy) -> list:
    pools = [SimPool("prefill", 1, MODEL, num_kv_blocks=1000), SimPool("decode", 1, MODEL, num_kv_blocks=1000)]
    # each prompt takes 110 ms of the one prefill instance: 20 req/s is twice what it can do
    requests = [SimRequest(i, i * 0.05, 100, 10) for i in range(200)]
    return Simulator(pools, policy=policy, slo=SLO(ttft_ms=500.0, tpot_ms=100.0)).run(requests)


def test_the_goodput_policy_refuses_what_would_miss_and_keeps_the_slo_of_what_it_admits():
    from disagg.placement.goodput import GoodputPolicy
    from disagg.placement.policies import LeastOutstandingWork

    refused = lambda rs: [r for r in rs if r.failed and r.failed.startswith("refused")]  # noqa: E731
    met = lambda rs: [r for r in rs if r.success and r.ttft_s <= 0.5 and r.tpot_s <= 0.1]  # noqa: E731
    least, good = _overloaded(LeastOutstandingWork()), _overloaded(GoodputPolicy())
    assert not refused(least) and len(met(least)) < 20  # every request queues: the later ones all miss
    admitted = [r for r in good if r not in refused(good)]
    assert 80 <= len(admitted) <= 120  # about what one prefill instance serves in time
    assert len(met(good)) >= 0.95 * len(admitted)
    assert "predicted TTFT" in refused(good)[0].failed
    assert {r.error_code for r in refused(good)} == {"RESOURCE_EXHAUSTED"}


# ---- instances sharing one host's cores --------------------------------------------------------------
def _shared_host(sharing) -> Simulator:
    pools = [SimPool("prefill", 1, MODEL, num_kv_blocks=1000), SimPool("decode", 1, MODEL, num_kv_blocks=1000)]
    return Simulator(pools, host_sharing=sharing)


def test_a_step_slows_while_another_instance_of_its_host_computes():
    from disagg.placement.latency_model import HostSharing

    a, b = SimRequest(0, 0.0, 20, 4), SimRequest(1, 0.037, 10, 2)
    # A: prefill 0-30 ms (the decode side idle), then 3 decode steps of 7 ms from 30 ms. At 37 ms
    # B's prefill (20 ms alone) starts: from then the decode run goes at 1/3 (beside a prefill)
    # and the prefill at 1/2 (beside decodes). The prefill ends at 37 + 40 = 77 ms, when the run has done 7 + 40/3 ms of its 21; the
    # rest (2/3 ms) goes at full speed: A ends at 77 2/3 ms, B's one decode step 7 ms later.
    first, second = _shared_host(HostSharing({"prefill": {"decode": 2.0}, "decode": {"prefill": 3.0}})).run([a, b])
    assert first.ttft_s * 1e3 == pytest.approx(30.0)
    assert first.e2el_s * 1e3 == pytest.approx(77.0 + 2 / 3)
    assert second.ttft_s * 1e3 == pytest.approx(40.0)
    assert second.finish_s * 1e3 == pytest.approx(77.0 + 2 / 3 + 7.0)


def test_without_sharing_the_same_requests_keep_their_times_alone():
    from disagg.placement.latency_model import HostSharing

    a, b = SimRequest(0, 0.0, 20, 4), SimRequest(1, 0.037, 10, 2)
    for sharing in (None, HostSharing(), HostSharing({"decode": {"decode": 3.0}})):  # decodes beside none
        first, second = _shared_host(sharing).run([a, b])
        assert first.e2el_s * 1e3 == pytest.approx(51.0)  # 30 + 3 * 7
        assert second.ttft_s * 1e3 == pytest.approx(20.0)


def test_one_instance_alone_on_its_host_is_never_slowed():
    from disagg.placement.latency_model import HostSharing

    pool = SimPool("colocated", 1, MODEL, num_kv_blocks=1000)
    [r] = Simulator([pool], host_sharing=HostSharing({"decode": {"decode": 3.0}, "prefill": {"decode": 2.0}})).run(
        [SimRequest(0, 0.0, 20, 4)]
    )
    assert r.e2el_s * 1e3 == pytest.approx(30.0 + 3 * 7.0)


# ---- sliding windows: the simulated block manager releases what leaves the window -----------------
def test_a_window_moves_only_the_prompts_last_window():
    """1 byte per token at 1 kB/s: a 400-token prompt under a 32-token window (16-token blocks)
    moves its last 2 blocks, 32 bytes in 32 ms (not 400 ms), and the decode side reserves those."""
    transfer = TransferModel(bandwidth_bytes_per_s=1000.0, latency_ms=0.0)
    windowed = [SimPool(role, 1, MODEL, num_kv_blocks=1000, sliding_window=32) for role in ("prefill", "decode")]
    [r] = Simulator(windowed, transfer=transfer, kv_bytes_per_token=1, num_layers=1).run([SimRequest(0, 0.0, 400, 2)])
    # prefill: 10 + 400 ms (one step); the KV 32 ms; then one decode step of 7 ms
    assert r.e2el_s * 1e3 == pytest.approx(410.0 + 32.0 + 7.0)
    assert windowed[1].prompt_blocks_held(400) == 2 and windowed[1].prompt_blocks_held(20) == 2
    whole = SimPool("decode", 1, MODEL, num_kv_blocks=1000)
    assert whole.prompt_blocks_held(400) == 25


def test_a_window_lets_requests_run_in_a_pool_too_small_for_their_whole_context():
    """8 blocks of 16 tokens: each 300-token request needs 20 without a window (refused), at most
    4 with a 32-token window and chunks of 16 (so two run at once)."""
    requests = [SimRequest(i, 0.0, 300, 10) for i in range(3)]
    pool = dict(num_kv_blocks=8, block_size=16, max_num_batched_tokens=16, long_prefill_token_threshold=0)
    refused = Simulator([SimPool("colocated", 1, MODEL, **pool)]).run(requests)
    assert not any(r.success for r in refused) and all(r.error_code == "INVALID_ARGUMENT" for r in refused)
    records = Simulator([SimPool("colocated", 1, MODEL, sliding_window=32, **pool)]).run(requests)
    assert all(r.success and r.output_len == 10 for r in records)


def test_the_memory_model_counts_a_windowed_requests_window():
    from disagg.engine.model_shapes import named_shapes
    from disagg.planner.memory import kv_tokens_held

    shapes = named_shapes()
    mistral, gemma, llama = shapes["mistral-7b-v0.1"], shapes["gemma3-12b"], shapes["llama3-8b"]
    assert kv_tokens_held(mistral, 8000) == 4096 + 16  # its 4,096-token window and the block it fills
    assert kv_tokens_held(mistral, 1000) == 1008
    assert kv_tokens_held(llama, 8000) == 8000
    assert kv_tokens_held(gemma, 8000) == 8000  # local and global layers: every block held
