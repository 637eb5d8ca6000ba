"""Scheduler and block manager lifecycle with a fake runner: no torch, no model."""

from __future__ import annotations

import pytest

from disagg.config import Role
from disagg.engine.block_manager import BlockManager
from disagg.engine.scheduler import SampledToken, Scheduler
from disagg.errors import OverloadedError
from disagg.request import Request, RequestStatus, SamplingParams

BLOCK = 4


def make_request(rid: str, prompt_len: int, max_tokens: int, first_token: int = 0, **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(
        rid,
        [first_token + i for i in range(prompt_len)],
        SamplingParams(temperature=0, max_tokens=max_tokens, **params),
        eos_token_ids=(2,),
    )


def make_scheduler(num_blocks: int = 64, budget: int = 16, role: Role = Role.COLOCATED, **kw) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, BLOCK), role=role, max_num_batched_tokens=budget, max_model_len=1024, **kw
    )


def run_fake_step(s: Scheduler, next_token=lambda r: 7):
    """One step with a fake runner: every sampling chunk produces `next_token(request)`."""
    out = s.schedule()
    _check_invariants(s, out)
    sampled = {c.request.request_id: SampledToken(next_token(c.request)) for c in out.chunks if c.samples}
    s.update_from_output(out, sampled)
    return out


def _check_invariants(s: Scheduler, out) -> None:
    # The budget holds, except that prefill-first runs one prompt longer than the budget whole.
    assert out.num_batched_tokens <= s.max_num_batched_tokens or (s.policy == "prefill_first" and len(out.chunks) == 1)
    for c in out.chunks:
        r = c.request
        assert c.start == r.num_computed_tokens
        assert len(r.block_ids) * BLOCK >= c.start + c.num_new_tokens, "chunk must fit its blocks"
        assert r.status is RequestStatus.RUNNING
    owned = [b for r in s.requests.values() for b in r.block_ids]
    # A block may be shared (prefix cache) but then its ref count says so.
    for b in set(owned):
        assert s.block_manager.ref_count(b) == owned.count(b)
    assert s.block_manager.num_free_blocks + len(set(owned)) == s.block_manager.num_total_blocks


def run_to_completion(s: Scheduler, max_steps: int = 10_000, **kw) -> list:
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outs
        outs.append(run_fake_step(s, **kw))
    raise AssertionError("scheduler did not finish (livelock or deadlock)")


def test_decodes_first_then_chunks_then_new_under_one_budget():
    # Fair prefill off: the first prompt takes what the decodes left (tests/unit/test_fair_prefill.py: on)
    s = make_scheduler(budget=16, long_prefill_token_threshold=0)
    s.add_request(make_request("a", 3, 5))
    run_fake_step(s)  # a: whole prompt
    s.add_request(make_request("b", 40, 2))
    s.add_request(make_request("c", 8, 2, first_token=100))  # no prefix shared with b
    out = run_fake_step(s)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 1), ("b", 15)]
    out = run_fake_step(s)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 1), ("b", 15)]
    out = run_fake_step(s)  # b's last 10 tokens, then c's first 5
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("a", 1), ("b", 10), ("c", 5)]
    assert not out.chunks[2].samples and out.chunks[1].samples


def test_every_request_finishes_with_its_length_and_every_block_is_freed():
    s = make_scheduler(num_blocks=64, budget=16)
    lengths = {f"r{i}": (1 + 7 * i % 37, 1 + 5 * i % 11) for i in range(12)}
    requests = {rid: make_request(rid, p, o) for rid, (p, o) in lengths.items()}
    for r in requests.values():
        s.add_request(r)
    run_to_completion(s)
    for rid, r in requests.items():
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == lengths[rid][1]
    assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks


def test_preemption_under_block_pressure_recomputes_and_finishes():
    # 10 blocks of 4 tokens; three requests of 12 + 16 tokens cannot all stay resident.
    s = make_scheduler(num_blocks=10, budget=64)
    requests = [make_request(f"r{i}", 12, 16) for i in range(3)]
    for r in requests:
        s.add_request(r)
    outs = run_to_completion(s)
    preempted = [r.request_id for o in outs for r in o.preempted]
    assert preempted, "expected preemption with 10 blocks"
    assert all(rid != "r0" for rid in preempted), "the oldest request is never the victim while others run"
    assert all(r.num_output_tokens == 16 for r in requests)
    assert sum(r.num_preemptions for r in requests) == len(preempted)
    assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks


def test_preempted_request_keeps_its_output_tokens_and_recomputes_them():
    s = make_scheduler(num_blocks=10, budget=64)
    requests = [make_request(f"r{i}", 12, 16) for i in range(3)]
    for r in requests:
        s.add_request(r)
    counter = iter(range(10_000))
    run_to_completion(s, next_token=lambda r: 100 + next(counter))
    for r in requests:
        assert r.token_ids == r.prompt_token_ids + r.output_token_ids
        assert len(set(r.output_token_ids)) == 16


def test_abort_frees_blocks_in_every_state():
    s = make_scheduler(num_blocks=16, budget=8)
    running, chunking, waiting = make_request("run", 4, 50), make_request("chunk", 30, 5), make_request("wait", 4, 5)
    for r in (running, chunking, waiting):
        s.add_request(r)
    run_fake_step(s)
    run_fake_step(s)
    assert running.status is RequestStatus.RUNNING and chunking.num_computed_tokens < chunking.num_prompt_tokens
    for r in (running, chunking, waiting):
        s.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED)
        assert r.status is RequestStatus.FINISHED_ABORTED and r.block_ids == []
    assert not s.has_unfinished_requests()
    assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks


def test_eos_and_stop_token_ids_finish_with_stop():
    s = make_scheduler()
    eos = make_request("eos", 4, 10, ignore_eos=False)
    stop = make_request("stop", 4, 10, stop_token_ids=[9])
    s.add_request(eos)
    s.add_request(stop)
    run_to_completion(s, next_token=lambda r: 2 if r.request_id == "eos" else 9)
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [2]
    assert stop.status is RequestStatus.FINISHED_STOPPED and stop.stop_reason == 9
    ignore = make_request("ignore", 4, 3)  # ignore_eos=True
    s.add_request(ignore)
    run_to_completion(s, next_token=lambda r: 2)
    assert ignore.status is RequestStatus.FINISHED_LENGTH and ignore.output_token_ids == [2, 2, 2]


def test_prefill_role_holds_blocks_until_released():
    s = make_scheduler(role=Role.PREFILL, budget=8)
    r = make_request("p", 19, 10)
    s.add_request(r)
    run_to_completion(s)
    assert r.output_token_ids == [7] and s.holds("p", RequestStatus.HELD_FOR_EXPORT)
    assert len(r.block_ids) == 5  # ceil(19 / 4): the prompt's KV, ready to export
    assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks - 5
    s.release("p")
    assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks


def test_decode_role_waits_for_kv_then_decodes_from_first_token():
    s = make_scheduler(role=Role.DECODE)
    r = make_request("d", 10, 4)
    assert s.reserve_for_remote_prefill(r)
    assert r.status is RequestStatus.WAITING_FOR_KV and len(r.block_ids) == 3
    assert s.schedule().is_empty, "nothing runs before the KV is in"
    s.finish_kv_import("d", first_token_id=42)
    out = run_fake_step(s)
    assert [(c.start, c.token_ids) for c in out.chunks] == [(10, [42])]
    run_to_completion(s)
    assert r.output_token_ids == [42, 7, 7, 7] and r.status is RequestStatus.FINISHED_LENGTH
    assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks


def test_decode_role_refuses_reservation_without_room():
    s = make_scheduler(num_blocks=4, role=Role.DECODE)
    assert s.reserve_for_remote_prefill(make_request("a", 12, 4))
    big = make_request("b", 12, 4)
    assert not s.reserve_for_remote_prefill(big)
    assert big.block_ids == [] and "b" not in s.requests


def test_bounded_waiting_queue_sheds():
    s = make_scheduler(max_waiting_requests=2)
    s.add_request(make_request("a", 4, 1))
    s.add_request(make_request("b", 4, 1))
    with pytest.raises(OverloadedError):
        s.add_request(make_request("c", 4, 1))


def test_duplicate_request_id_rejected():
    s = make_scheduler()
    s.add_request(make_request("a", 4, 1))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(make_request("a", 4, 1))


def test_prefix_cache_reuses_full_blocks_of_a_finished_request():
    s = make_scheduler(num_blocks=32, budget=64)
    first = make_request("first", 18, 2)
    s.add_request(first)
    run_to_completion(s)
    second = make_request("second", 18, 2)  # same prompt tokens
    s.add_request(second)
    out = run_fake_step(s)
    assert second.num_cached_tokens == 16  # four full blocks of the prompt, the rest recomputed
    assert out.chunks[0].start == 16 and out.chunks[0].num_new_tokens == 2
    run_to_completion(s)
    assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks


def test_prefix_cache_never_serves_a_block_whose_tokens_differ():
    bm = BlockManager(8, BLOCK)
    a = make_request("a", 9, 1)
    assert bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    b = make_request("b", 9, 1, first_token=1)  # different tokens
    assert bm.find_cached_prefix(b) == []
    c = make_request("c", 9, 1)
    assert bm.find_cached_prefix(c) == a.block_ids[:2]


def test_freed_cached_block_is_evicted_before_reuse_for_other_content():
    bm = BlockManager(3, BLOCK)
    a = make_request("a", 8, 1)
    assert bm.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.free(a)
    # New content takes all three blocks, including the two cached ones: their hashes must go.
    other = make_request("o", 12, 1, first_token=50)
    assert bm.allocate_slots(other, 12)
    assert bm.find_cached_prefix(make_request("again", 8, 1)) == []


def test_prefill_first_runs_whole_prompts_and_stalls_decodes():
    s = make_scheduler(budget=16, policy="prefill_first")
    s.add_request(make_request("a", 3, 5))
    run_fake_step(s)  # a's prompt
    s.add_request(make_request("long", 40, 2, first_token=100))  # longer than the budget: still whole
    out = run_fake_step(s)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("long", 40)], (
        "decodes stall while a prompt runs"
    )
    out = run_fake_step(s)
    assert sorted(c.request.request_id for c in out.chunks) == ["a", "long"] and all(
        c.num_new_tokens == 1 for c in out.chunks
    )
    run_to_completion(s)
    assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks


def test_unknown_policy_rejected():
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_scheduler(policy="fifo")


def _decoding(num_blocks: int, lengths: list[tuple[int, int]], budget: int = 64) -> Scheduler:
    """A scheduler whose requests have all passed their prefill and are decoding."""
    s = make_scheduler(num_blocks=num_blocks, budget=budget)
    for i, (prompt_len, max_tokens) in enumerate(lengths):
        s.add_request(make_request(f"r{i}", prompt_len, max_tokens))
    while s.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in s.running):
        run_fake_step(s)
    return s


def _state(s: Scheduler) -> list:
    # Block counts, not ids: one step at a time interleaves the requests' allocations, a jump does not.
    return [
        (r.request_id, r.num_computed_tokens, list(r.output_token_ids), len(r.block_ids), r.status)
        for r in list(s.running) + [r for r in s.requests.values() if r not in s.running]
    ]


@pytest.mark.parametrize("lengths", [[(5, 9), (20, 30), (33, 12)], [(1, 40)], [(15, 2), (16, 3), (17, 50)]])
def test_advance_decodes_equals_as_many_single_steps(lengths):
    stepped, jumped = _decoding(64, lengths), _decoding(64, lengths)
    steps = jumped.plain_decode_steps()
    assert steps >= 1
    for _ in range(steps):
        run_fake_step(stepped)
    jumped.advance_decodes(steps, 7)
    assert _state(jumped) == _state(stepped)
    assert jumped.block_manager.num_free_blocks == stepped.block_manager.num_free_blocks


def test_plain_decode_steps_stop_short_of_a_preemption_or_a_waiting_request():
    s = _decoding(6, [(4, 100), (4, 100)])  # blocks of 4: one each, 4 free: 8 more tokens each at most
    assert s.plain_decode_steps() == 8
    with pytest.raises(ValueError):
        s.advance_decodes(9, 7)
    s.add_request(make_request("late", 4, 4))
    assert s.plain_decode_steps() == 0  # the next step admits it: not a plain decode step


def test_a_routers_prompt_hashes_are_the_blocks_an_instance_reports_cached():
    """What a router computes of a prompt (BlockManager.prompt_hashes) names the blocks the
    instance reports (cached_hashes) once the prompt ran: the prefix-aware placement's index."""
    s = make_scheduler()
    request = make_request("a", 4 * BLOCK + 2, 1)
    s.add_request(request)
    while s.has_unfinished_requests():
        run_fake_step(s)
    reported = set(s.block_manager.cached_hashes(limit=100))
    hashes = BlockManager.prompt_hashes(request.prompt_token_ids, BLOCK)
    assert len(hashes) == 4 and set(hashes) <= reported
    other = BlockManager.prompt_hashes([9] + request.prompt_token_ids[1:], BLOCK)
    assert not set(other) & reported  # chained: a different first block changes every hash


def test_prompt_hashes_are_the_same_in_every_process():
    """The router and the instances are different processes: a hash that depends on the process
    (Python < 3.12 hashes None by its address) would never match an instance's cached blocks."""
    import subprocess
    import sys

    tokens = list(range(3 * BLOCK + 1))
    code = f"from disagg.engine.block_manager import BlockManager; print(BlockManager.prompt_hashes({tokens}, {BLOCK}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(BlockManager.prompt_hashes(tokens, BLOCK))
