"""The simulator replays either scheduling order (issue 39): its instances' schedulers order by
the requests' predicted output lengths under ltr, and age waiting requests on the simulated
clock, so the starvation bound holds in a replay as it does in the engine."""

from __future__ import annotations

import time
from statistics import mean

import pytest

from disagg.config import ServingConfig
from disagg.placement.latency_model import Coefficients, StepModel
from disagg.planner.predicted_lengths import exact_lengths, noisy_oracle, with_predicted_lengths
from disagg.planner.simulator import SimPool, SimRecord, Simulator, pools_from_config
from disagg.planner.workload import SimRequest, with_rate

# prefill: 10 ms + 1 ms per token; decode: 5 ms + 2 ms per request in the batch
MODEL = StepModel(
    prefill=Coefficients(10.0, 1.0, 0.0),
    decode_small=Coefficients(5.0, 0.0, 2.0),
    decode_large=Coefficients(5.0, 0.0, 2.0),
)
PROMPT, LONG, SHORT = 10, 200, 10
# One request alone (max_num_seqs 1): its prefill step, then a decode step of 7 ms per token after the first.
SHORT_ALONE_S = (10 + PROMPT + (SHORT - 1) * 7) / 1e3
LONG_ALONE_S = (10 + PROMPT + (LONG - 1) * 7) / 1e3


def one_instance(order: str, max_num_seqs: int, priority_aging_s: float = 10.0) -> Simulator:
    """One instance whose few batch slots make a queue: where the order decides who waits."""
    pool = SimPool(
        "colocated",
        1,
        MODEL,
        num_kv_blocks=1000,
        max_num_seqs=max_num_seqs,
        scheduling_order=order,
        priority_aging_s=priority_aging_s,
    )
    return Simulator([pool])


def burst() -> list[SimRequest]:
    """Ten long requests, then ten short ones, all at once."""
    longs = [SimRequest(i, 0.0, PROMPT, LONG) for i in range(10)]
    shorts = [SimRequest(10 + i, 0.0, PROMPT, SHORT) for i in range(10)]
    return longs + shorts


def mean_latency_s(records: list[SimRecord], output_len: int | None = None) -> float:
    assert all(r.success for r in records)
    return mean(r.e2el_s for r in records if output_len is None or r.output_len == output_len)


def test_ltr_with_exact_lengths_serves_the_short_requests_of_a_burst_first():
    requests = with_predicted_lengths(burst(), exact_lengths)
    fcfs = one_instance("fcfs", max_num_seqs=2).run(requests)
    ltr = one_instance("ltr", max_num_seqs=2).run(requests)
    # fcfs: the shorts wait for five pairs of longs (about 9.4 s); ltr: they go first (about 0.33 s)
    assert mean_latency_s(ltr, SHORT) < mean_latency_s(fcfs, SHORT) / 10
    assert mean_latency_s(ltr) < mean_latency_s(fcfs) / 2  # 3.2 s against 7.5 s
    # what the longs pay for it: the shorts' five pairs (a prefill step of two prompts, then
    # nine decode steps of two)
    shorts_s = 5 * (10 + 2 * PROMPT + (SHORT - 1) * (5 + 2 * 2)) / 1e3
    assert mean_latency_s(ltr, LONG) == pytest.approx(mean_latency_s(fcfs, LONG) + shorts_s)


def test_a_noisier_ranker_keeps_less_of_the_gain():
    requests = burst()
    fcfs = mean_latency_s(one_instance("fcfs", 2).run(requests), SHORT)
    exact = mean_latency_s(one_instance("ltr", 2).run(with_predicted_lengths(requests, exact_lengths)), SHORT)
    noisy = mean_latency_s(one_instance("ltr", 2).run(with_predicted_lengths(requests, noisy_oracle(2.0))), SHORT)
    assert exact < noisy < fcfs


def test_fcfs_ignores_predicted_lengths():
    plain = one_instance("fcfs", 2).run(burst())
    predicted = one_instance("fcfs", 2).run(with_predicted_lengths(burst(), noisy_oracle(1.0)))
    assert [r.finish_s for r in predicted] == [r.finish_s for r in plain]


def long_among_a_stream_of_shorts() -> list[SimRequest]:
    """A short request holding the one slot, a long one queued behind it, then shorts every
    50 ms for 10 s: faster than one slot serves them (one per 83 ms), so under ltr without
    aging the long one would wait until they stop."""
    shorts = [SimRequest(2 + i, 0.002 + 0.05 * i, PROMPT, SHORT) for i in range(200)]
    requests = [SimRequest(0, 0.0, PROMPT, SHORT), SimRequest(1, 0.001, PROMPT, LONG), *shorts]
    return with_predicted_lengths(requests, exact_lengths)


def aging_bound_s(requests: list[SimRequest], aging_s: float) -> float:
    """When the long request (index 1) must have finished: it is ahead of every short that came
    more than `aging_s` after it (disagg.engine.queue_order), so at worst it waits for those
    that came before then, one at a time, then runs alone."""
    long = requests[1]
    ahead = sum(1 for r in requests if r.output_len == SHORT and r.arrival_s <= long.arrival_s + aging_s)
    return long.arrival_s + ahead * SHORT_ALONE_S + LONG_ALONE_S


def test_without_aging_the_long_request_starves_until_the_shorts_stop():
    requests = long_among_a_stream_of_shorts()
    records = one_instance("ltr", max_num_seqs=1, priority_aging_s=1e9).run(requests)
    assert records[1].finish_s == pytest.approx(max(r.finish_s for r in records))  # the last to finish
    assert records[1].finish_s > 15.0


def test_aging_bounds_the_long_requests_wait_in_the_simulator():
    requests = long_among_a_stream_of_shorts()
    records = one_instance("ltr", max_num_seqs=1, priority_aging_s=0.5).run(requests)
    assert all(r.success for r in records)
    assert records[1].finish_s <= aging_bound_s(requests, 0.5)  # about 2 s, against 18 s without aging


def test_waits_are_measured_on_the_simulated_clock():
    """18 simulated seconds replay in a fraction of one: on the wall clock no request would wait
    long enough to age, and the long one would starve."""
    aging_s = 2.0
    requests = long_among_a_stream_of_shorts()
    sim = one_instance("ltr", max_num_seqs=1, priority_aging_s=aging_s)
    queued_at = {}

    def look_at_the_queue(_: SimRequest) -> None:
        for request in sim.instances["colocated"][0].scheduler.waiting:
            queued_at[request.request_id] = (request.arrival_time, request.queued_at, sim.now)

    sim.on_arrive = look_at_the_queue
    started = time.perf_counter()
    records = sim.run(requests)
    wall_s = time.perf_counter() - started
    assert wall_s < aging_s  # so only the simulated clock can have aged anyone
    assert records[1].finish_s <= aging_bound_s(requests, aging_s) < 10.0
    assert queued_at and all(arrival <= queued <= now for arrival, queued, now in queued_at.values())


def test_pools_from_config_carry_each_pools_order_and_aging():
    config = ServingConfig.from_dict(
        {
            "engine": {"num_kv_blocks": 100, "scheduling_order": "ltr", "priority_aging_s": 3.0},
            "prefill": {"num_instances": 1, "engine": {"scheduling_order": "fcfs"}},
            "decode": {"num_instances": 1},
        }
    )
    pools = {p.role: p for p in pools_from_config(config, lambda role, tp, pp: MODEL, kv_bytes_per_token=1)}
    assert (pools["prefill"].scheduling_order, pools["prefill"].priority_aging_s) == ("fcfs", 3.0)
    assert (pools["decode"].scheduling_order, pools["decode"].priority_aging_s) == ("ltr", 3.0)
    sim = Simulator(list(pools.values()))
    assert sim.instances["decode"][0].scheduler.order == "ltr"
    assert sim.instances["prefill"][0].scheduler.priority_aging_s == 3.0


def test_the_noisy_oracle_is_seeded_per_request_and_exact_without_noise():
    requests = [SimRequest(i, 0.0, PROMPT, 100) for i in range(50)]
    noisy = noisy_oracle(1.0, seed=7)
    assert [noisy(r) for r in requests] == [noisy(r) for r in reversed(requests)][::-1]
    assert len({noisy(r) for r in requests}) > 10 and all(noisy(r) >= 1 for r in requests)
    assert [noisy_oracle(0.0)(r) for r in requests] == [100] * 50
    with pytest.raises(ValueError):
        noisy_oracle(-1.0)


def test_predicted_lengths_and_priorities_survive_a_new_rate():
    requests = with_predicted_lengths([SimRequest(0, 0.0, PROMPT, 100, priority=1)], lambda r: 42)
    [moved] = with_rate(requests, rate=5.0)
    assert (moved.predicted_output_len, moved.priority) == (42, 1)


def test_a_sheddable_request_waits_behind_a_standard_one_that_came_later():
    requests = [
        SimRequest(0, 0.0, PROMPT, SHORT),  # holds the one slot
        SimRequest(1, 0.001, PROMPT, SHORT, priority=1),
        SimRequest(2, 0.002, PROMPT, SHORT, priority=0),
    ]
    holder, sheddable, standard = one_instance("fcfs", max_num_seqs=1).run(requests)
    assert holder.finish_s < standard.finish_s < sheddable.finish_s
