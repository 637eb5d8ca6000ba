"""Priorities inside an engine (disagg.engine.queue_order and the scheduler): critical before
standard before sheddable in the waiting queue, the batch and preemption, first-come-first-served
within one, and a bound on every request's wait however many better ones keep coming. Pure: a
fake runner and a fake clock, no torch."""

from __future__ import annotations

import itertools
import math

import pytest

from disagg.config import EngineConfig, Role
from disagg.engine.block_manager import BlockManager
from disagg.engine.queue_order import preemption_victim, waiting_order
from disagg.engine.scheduler import SampledToken, Scheduler
from disagg.errors import InvalidRequestError
from disagg.request import PRIORITY_VALUES, Request, SamplingParams, priority_value

BLOCK = 4
CRITICAL, STANDARD, SHEDDABLE = (PRIORITY_VALUES[n] for n in ("critical", "standard", "sheddable"))
_first_tokens = itertools.count(0, 100)  # each request's prompt its own: nothing is served from the prefix cache


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def request(rid: str, priority: int = STANDARD, prompt_len: int = 4, max_tokens: int = 1, **kw) -> Request:
    first = next(_first_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, [first + i for i in range(prompt_len)], params, priority=priority, **kw)


def scheduler(clock=None, num_blocks: int = 64, **kw) -> Scheduler:
    kw.setdefault("max_num_batched_tokens", 64)
    return Scheduler(BlockManager(num_blocks, BLOCK), max_model_len=1024, clock=clock or FakeClock(), **kw)


def step(s: Scheduler):
    out = s.schedule()
    s.update_from_output(out, {c.request.request_id: SampledToken(7) for c in out.chunks if c.samples})
    return out


def admitted_in_order(s: Scheduler, max_steps: int = 100) -> list[str]:
    """Request ids in the order their prompts were first scheduled."""
    order = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return order
        order += [c.request.request_id for c in step(s).chunks if c.start == 0]
    raise AssertionError("the scheduler did not finish")


# ---- the waiting queue -----------------------------------------------------------------------------
def test_a_critical_request_that_came_later_is_admitted_first_and_each_class_is_fcfs():
    s = scheduler(max_num_seqs=1)  # one at a time: the admission order is the whole story
    for rid, priority in [("s1", SHEDDABLE), ("n1", STANDARD), ("c1", CRITICAL), ("n2", STANDARD), ("c2", CRITICAL)]:
        s.add_request(request(rid, priority))
    assert admitted_in_order(s) == ["c1", "c2", "n1", "n2", "s1"]


def test_one_class_keeps_its_queue_order_whatever_the_waits():
    """As before priorities: a preempted request goes back to the front, even ahead of requests
    that waited longer (on a decode instance, one prefilled there may wait longer than one
    whose KV came from a prefill instance, then was preempted)."""
    preempted = request("preempted", queued_at=5.0)
    waited_longer = request("waited-longer", queued_at=0.0)
    queue = [preempted, waited_longer, request("new", queued_at=19.0)]
    assert waiting_order(queue, 20.0, "fcfs", 1.0) == queue
    # With a more urgent class waiting, the others rise to it at most: then it is the queue's order.
    critical = request("critical", CRITICAL, queued_at=19.5)
    assert waiting_order([*queue, critical], 20.0, "fcfs", 1.0) == [*queue, critical]
    assert waiting_order([*queue, critical], 19.5, "fcfs", 1.0) == [preempted, waited_longer, critical, queue[2]]


def test_prefill_first_admits_by_priority_too():
    s = scheduler(max_num_seqs=1, policy="prefill_first")
    s.add_request(request("late-sheddable", SHEDDABLE))
    s.add_request(request("critical", CRITICAL))
    assert admitted_in_order(s) == ["critical", "late-sheddable"]


@pytest.mark.parametrize("order", ["fcfs", "ltr"])
def test_an_old_sheddable_request_is_served_within_its_bound_however_many_critical_ones_arrive(order):
    """Critical requests keep coming, three a step, one served a step. The sheddable one rises a
    class per aging_s: it passes every critical one that came two classes' aging after it
    (under ltr, where critical ones predicted short win ties, three)."""
    aging_s, step_s = 1.0, 0.25
    clock = FakeClock()
    s = scheduler(clock, max_num_seqs=1, order=order, priority_aging_s=aging_s)
    s.add_request(request("old", SHEDDABLE))
    arrived, served_before = {}, []
    while clock.now < 100 * aging_s:
        for _ in range(3):
            rid = f"c{len(arrived)}"
            s.add_request(request(rid, CRITICAL, predicted_output_len=1))
            arrived[rid] = clock.now
        admitted = [c.request.request_id for c in step(s).chunks]
        if admitted == ["old"]:
            break
        served_before += admitted
        clock.now += step_s
    assert admitted == ["old"], "the sheddable request was never served"
    bound = (2 if order == "fcfs" else 3) * aging_s
    assert max(arrived[rid] for rid in served_before) < bound
    assert len(s.waiting) > 10  # critical ones were still waiting when it went
    if order == "fcfs":  # the critical ones waiting then all came after it: it goes first among equals
        assert clock.now <= bound


def test_without_the_bound_the_same_sheddable_request_starves():
    """The scenario above with aging off: what the bound prevents."""
    clock = FakeClock()
    s = scheduler(clock, max_num_seqs=1, priority_aging_s=math.inf)
    s.add_request(request("old", SHEDDABLE))
    for index in range(100):
        s.add_request(request(f"c{index}", CRITICAL))
        assert all(c.request.request_id != "old" for c in step(s).chunks)
        clock.now += 0.25


def test_ltr_admits_the_shortest_predicted_first_and_a_long_one_within_its_bound():
    clock = FakeClock()
    s = scheduler(clock, max_num_seqs=1, order="ltr", priority_aging_s=1.0)
    s.add_request(request("long", predicted_output_len=500))
    s.add_request(request("unknown"))
    s.add_request(request("short", predicted_output_len=5))
    assert [c.request.request_id for c in step(s).chunks] == ["short"]
    served_at, index = None, 0
    while served_at is None and clock.now < 50:
        s.add_request(request(f"short{index}", predicted_output_len=5))
        index += 1
        if any(c.request.request_id == "long" for c in step(s).chunks):
            served_at = clock.now
        clock.now += 0.25
    assert served_at is not None and served_at <= 1.0 + 0.25, f"served at {served_at}"


def test_waiting_order_is_a_pure_function_of_the_queue_and_the_time():
    old = request("old", SHEDDABLE, queued_at=0.0)
    fresh = request("fresh", CRITICAL, queued_at=9.5)
    standard = request("standard", STANDARD, queued_at=5.0)
    queue = [old, standard, fresh]
    assert [r.request_id for r in waiting_order(queue, 9.5, "fcfs", 10.0)] == ["fresh", "standard", "old"]
    # At 20 s the sheddable one has waited two classes up (to critical) and is older than the
    # critical one; the standard one rose to critical too: all three are equals, in queue order.
    assert [r.request_id for r in waiting_order(queue, 20.0, "fcfs", 10.0)] == ["old", "standard", "fresh"]


# ---- the batch and preemption ----------------------------------------------------------------------
def test_preemption_takes_the_sheddable_request_not_the_latest():
    """Four blocks: three one-block prompts, then each needs a second block to decode. The
    sheddable request ran first; under FCFS the latest (standard) one would go."""
    s = scheduler(num_blocks=4)
    s.add_request(request("sheddable", SHEDDABLE, max_tokens=8))
    step(s)
    s.add_request(request("critical", CRITICAL, max_tokens=8))
    s.add_request(request("standard", STANDARD, max_tokens=8))
    step(s)  # the sheddable one decodes (its second block), the others prefill (the last blocks)
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["sheddable"]
    assert sorted(c.request.request_id for c in out.chunks) == ["critical", "standard"]
    assert [r.request_id for r in s.waiting] == ["sheddable"]


def test_the_victim_is_the_lowest_priority_then_the_latest_or_under_ltr_the_longest_predicted():
    a = request("a", STANDARD, predicted_output_len=100)
    b = request("b", SHEDDABLE, predicted_output_len=10)
    c = request("c", STANDARD, predicted_output_len=1)
    d = request("d", CRITICAL)
    assert preemption_victim([a, b, c, d], "fcfs") is b
    assert preemption_victim([a, c, d], "fcfs") is c  # the latest of the lowest class
    assert preemption_victim([a, c, d], "ltr") is a  # the longest predicted remaining
    assert preemption_victim([c, request("e", STANDARD)], "ltr").request_id == "e"  # no prediction: longest
    assert preemption_victim([], "fcfs") is None


def test_critical_decodes_get_the_budget_first():
    s = scheduler(max_num_batched_tokens=3)
    for rid, priority in [("s", SHEDDABLE), ("n", STANDARD), ("c", CRITICAL)]:
        s.add_request(request(rid, priority, prompt_len=1, max_tokens=8))
        step(s)  # running in the order they came: sheddable, standard, critical
    assert [r.request_id for r in s.running] == ["s", "n", "c"]
    s.max_num_batched_tokens = 2  # room for two of the three decodes
    assert [c.request.request_id for c in step(s).chunks] == ["c", "n"]


# ---- displacement: a full batch makes room for a more urgent request ---------------------------------
def decoding(s: Scheduler, *requests: Request) -> None:
    """Reserve each on a DECODE scheduler and import its KV: each then decodes."""
    for r in requests:
        assert s.reserve_for_remote_prefill(r)
        s.finish_kv_import(r.request_id, 7)


def decode_scheduler(clock=None, **kw) -> Scheduler:
    return scheduler(clock, role=Role.DECODE, max_num_seqs=2, **kw)


def test_a_critical_reservation_suspends_the_sheddable_decode_and_it_resumes_when_a_slot_frees():
    s = decode_scheduler()
    decoding(s, request("sheddable", SHEDDABLE, max_tokens=50), request("standard", STANDARD, max_tokens=3))
    blocks = list(s.requests["sheddable"].block_ids)
    assert not s.reserve_for_remote_prefill(request("also-sheddable", SHEDDABLE))  # no one it outranks
    decoding(s, request("critical", CRITICAL, max_tokens=50))
    assert [r.request_id for r in s.suspended] == ["sheddable"] and s.requests[
        "sheddable"
    ].block_ids == blocks  # KV kept
    assert sorted(c.request.request_id for c in step(s).chunks) == ["critical", "standard"]
    step(s)  # the standard one ends (3 tokens): its slot frees
    assert sorted(c.request.request_id for c in step(s).chunks) == ["critical", "sheddable"]
    assert not s.suspended


def test_under_fcfs_a_request_of_the_same_class_never_displaces():
    s = decode_scheduler()
    decoding(s, request("a", max_tokens=50, predicted_output_len=50), request("b", max_tokens=50))
    assert not s.reserve_for_remote_prefill(request("short", predicted_output_len=1))
    assert not s.suspended


def test_under_ltr_only_a_much_shorter_prediction_displaces_the_longest_predicted():
    s = decode_scheduler(order="ltr")
    decoding(s, request("long", max_tokens=300, predicted_output_len=200))
    decoding(s, request("mid", max_tokens=300, predicted_output_len=120))
    assert not s.reserve_for_remote_prefill(request("not-short-enough", predicted_output_len=101))
    assert not s.reserve_for_remote_prefill(request("unknown"))  # no prediction: never displaces
    decoding(s, request("short", max_tokens=300, predicted_output_len=90))
    assert [r.request_id for r in s.suspended] == ["long"]


def test_a_suspended_request_is_back_within_its_bound_however_many_short_ones_arrive():
    """Under ltr, short requests arrive every step and displace the long one; none of them ends.
    A suspended request ages from its suspension, keeping the rise it had earned, so each of the
    long one's suspensions ends within aging_s, and it runs most steps."""
    aging_s, step_s = 1.0, 0.25
    clock = FakeClock()
    s = decode_scheduler(clock, order="ltr", priority_aging_s=aging_s, num_blocks=1000)
    decoding(s, request("long", max_tokens=1000, predicted_output_len=900))
    ran_long, suspended_since, longest = 0, None, 0.0
    for index in range(int(10 * aging_s / step_s)):
        newcomer = request(f"short{index}", max_tokens=1000, predicted_output_len=10)
        if s.reserve_for_remote_prefill(newcomer):
            s.finish_kv_import(newcomer.request_id, 7)
        if "long" in {c.request.request_id for c in step(s).chunks}:
            ran_long += 1
            suspended_since = None
        else:
            suspended_since = clock.now if suspended_since is None else suspended_since
            longest = max(longest, clock.now - suspended_since)
        clock.now += step_s
    assert s.requests["long"].num_preemptions == 0 and longest > 0  # it was suspended, never recomputed
    assert longest <= aging_s, f"suspended for {longest} s at once"
    assert ran_long >= 20  # of 40 steps


def test_a_colocated_engine_suspends_for_a_critical_prompt_that_waits():
    s = scheduler(max_num_seqs=1)
    s.add_request(request("sheddable", SHEDDABLE, max_tokens=50))
    step(s)
    s.add_request(request("critical", CRITICAL, max_tokens=2))
    assert [c.request.request_id for c in step(s).chunks] == ["critical"]
    assert [r.request_id for r in s.suspended] == ["sheddable"]
    step(s)  # the critical one's last token
    assert [c.request.request_id for c in step(s).chunks] == ["sheddable"]


def test_under_block_pressure_the_suspended_request_is_preempted_before_a_running_one():
    s = decode_scheduler(num_blocks=4)
    decoding(s, request("sheddable", SHEDDABLE, max_tokens=50), request("standard", STANDARD, max_tokens=50))
    decoding(s, request("critical", CRITICAL, max_tokens=50))  # one block each; the last one free
    out = step(s)  # each decode needs a second block: the critical one takes the free one, then...
    assert [r.request_id for r in out.preempted] == ["sheddable"]
    assert [r.request_id for r in s.waiting] == ["sheddable"] and not s.suspended
    assert sorted(c.request.request_id for c in out.chunks) == ["critical", "standard"]


def test_at_most_max_num_seqs_requests_are_suspended():
    s = decode_scheduler(num_blocks=64)
    decoding(s, *(request(f"shed{i}", SHEDDABLE, max_tokens=50) for i in range(2)))
    decoding(s, *(request(f"std{i}", STANDARD, max_tokens=50) for i in range(2)))
    assert len(s.suspended) == 2
    assert not s.reserve_for_remote_prefill(request("critical", CRITICAL))  # room to suspend is gone
    assert len(s.running) == 2 and s.has_unfinished_requests()


# ---- settings --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, field",
    [
        ({"scheduling_order": "sjf"}, "scheduling_order"),
        ({"priority_aging_s": 0}, "priority_aging_s"),
        ({"priority_aging_s": -1.0}, "priority_aging_s"),
        ({"priority_aging_s": math.nan}, "priority_aging_s"),
        ({"priority_aging_s": "10"}, "priority_aging_s"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**changes)


def test_the_scheduler_refuses_what_the_config_would():
    with pytest.raises(ValueError, match="scheduling_order"):
        scheduler(order="random")
    with pytest.raises(ValueError, match="priority_aging_s"):
        scheduler(priority_aging_s=0.0)


def test_priority_names_and_vllm_integers():
    assert [priority_value(n) for n in ("critical", "standard", "sheddable")] == [-1, 0, 1]
    assert priority_value(5) == 5 and priority_value(-3) == -3
    for bad in ("urgent", 1.5, True, None):
        with pytest.raises(InvalidRequestError, match="priority"):
            priority_value(bad)
