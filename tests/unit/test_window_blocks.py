"""Sliding windows in the paged cache, scheduler and block manager alone (a fake runner, no
torch): a windowed request's blocks are released as they fall out of the window, what it holds
stays within the window's, placeholders are never freed twice, prefix caching stays exact, and
a decode reservation holds only the prompt's last window."""

from __future__ import annotations

import pytest

from disagg.config import Role
from disagg.engine.block_manager import (
    PLACEHOLDER,
    BlockManager,
    max_blocks_held,
    num_held,
    out_of_window_blocks,
)
from disagg.engine.scheduler import SampledToken, Scheduler
from disagg.errors import InvalidRequestError
from disagg.request import Request, SamplingParams, check_fits

BLOCK = 4
WINDOW = 8


def make_request(rid: str, prompt: list[int], max_tokens: int = 6) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def make_scheduler(num_blocks: int, window: int | None = WINDOW, budget: int = 16, **kw) -> Scheduler:
    bm = BlockManager(num_blocks, BLOCK, sliding_window=window, **kw)
    return Scheduler(bm, max_num_batched_tokens=budget, long_prefill_token_threshold=0, max_model_len=4096)


def step(s: Scheduler, next_token=lambda r: 7):
    out = s.schedule()
    for c in out.chunks:  # what the attention reads of the chunk: from its first query's window on
        first_read = max(0, c.start - WINDOW + 1) // BLOCK
        assert PLACEHOLDER not in c.request.block_ids[first_read:], "a chunk would read a released block"
    s.update_from_output(
        out, {c.request.request_id: SampledToken(next_token(c.request)) for c in out.chunks if c.samples}
    )
    _check_counts(s)
    return out


def _check_counts(s: Scheduler) -> None:
    """Every held block's ref count says who holds it; placeholders lead each table and are counted."""
    bm = s.block_manager
    held = [b for r in s.requests.values() for b in r.block_ids if b != PLACEHOLDER]
    for r in s.requests.values():
        assert r.block_ids[: r.num_released_blocks] == [PLACEHOLDER] * r.num_released_blocks
        assert PLACEHOLDER not in r.block_ids[r.num_released_blocks :]
    for b in set(held):
        assert bm.ref_count(b) == held.count(b)
    assert bm.num_free_blocks + len(set(held)) == bm.num_total_blocks


def run(s: Scheduler, max_steps: int = 2000, **kw) -> dict[str, list[int]]:
    outputs = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outputs
        out = step(s, **kw)
        for c in out.chunks:
            outputs[c.request.request_id] = list(c.request.output_token_ids)
    raise AssertionError("the scheduler did not finish")


def test_the_window_arithmetic():
    # Once n positions are computed, the next read starts at n - W + 1: blocks wholly before go.
    assert [out_of_window_blocks(n, 4, 8) for n in (0, 8, 10, 11, 12, 15, 16)] == [0, 0, 0, 1, 1, 2, 2]
    assert out_of_window_blocks(1000, 4, None) == 0
    assert max_blocks_held(1000, 4, None, 16) == 250
    assert max_blocks_held(1000, 4, 8, 1) == 3  # a decode: its window's blocks and the one it writes
    assert max_blocks_held(1000, 4, 8, 16) == 7
    assert max_blocks_held(6, 4, 8, 16) == 2  # never more than its tokens'


def test_a_windowed_request_holds_its_window_and_frees_everything_at_the_end():
    s = make_scheduler(64)
    request = make_request("a", list(range(100, 150)), max_tokens=20)
    s.add_request(request)
    peak = 0
    while s.has_unfinished_requests():
        step(s)
        peak = max(peak, s.block_manager.num_used_blocks)
        if not request.is_finished and request.num_computed_tokens >= request.num_prompt_tokens:  # decoding
            assert num_held(request.block_ids) <= -(-WINDOW // BLOCK) + 1
            assert request.num_released_blocks == out_of_window_blocks(request.num_computed_tokens, BLOCK, WINDOW)
    assert peak <= max_blocks_held(70, BLOCK, WINDOW, 16)
    assert s.block_manager.num_free_blocks == 64
    assert request.block_ids == [] and request.num_released_blocks == 0


def test_without_a_window_nothing_is_released():
    s = make_scheduler(64, window=None)
    request = make_request("a", list(range(100, 150)), max_tokens=4)
    s.add_request(request)
    step(s)
    step(s)
    assert request.num_released_blocks == 0 and PLACEHOLDER not in request.block_ids


def test_more_windowed_requests_fit_than_whole_ones():
    """12 blocks: each 50-token prompt needs 14 without the window, at most 7 with it."""
    with pytest.raises(InvalidRequestError):
        check_fits(50, 6, 4096, BLOCK, 12)
    check_fits(50, 6, 4096, BLOCK, 12, max_blocks_held=max_blocks_held(56, BLOCK, WINDOW, 16))
    s = make_scheduler(12)
    prompts = {f"r{i}": [1000 * i + t for t in range(50)] for i in range(3)}
    for rid, prompt in prompts.items():
        s.add_request(make_request(rid, prompt))
    outputs = run(s)
    assert sorted(outputs) == sorted(prompts) and all(len(o) == 6 for o in outputs.values())
    assert s.block_manager.num_free_blocks == 12


def test_released_blocks_stay_cached_and_a_prefix_hit_is_exact():
    """A released block keeps its hash: the same prompt again finds its prefix, takes only the
    blocks its window still reads, and the tokens come out the same as without caching."""
    s = make_scheduler(64)
    prompt = list(range(200, 240))
    first = make_request("first", prompt)
    s.add_request(first)
    run(s, next_token=lambda r: 1 + r.num_tokens % 5)
    again = make_request("again", prompt)
    hits = s.block_manager.find_cached_prefix(again)
    assert len(hits) == (len(prompt) - 1) // BLOCK  # every full block but the last token's
    s.add_request(again)
    step(s, next_token=lambda r: 1 + r.num_tokens % 5)
    assert again.num_cached_tokens == len(hits) * BLOCK
    # The hits the window had left behind were not taken: only the window's are held.
    assert again.num_released_blocks == out_of_window_blocks(again.num_computed_tokens, BLOCK, WINDOW)
    run(s, next_token=lambda r: 1 + r.num_tokens % 5)
    assert again.output_token_ids == first.output_token_ids
    shared = make_request("shared", prompt[:20] + list(range(900, 920)))
    s.add_request(shared)
    step(s)
    assert shared.num_cached_tokens == 20  # only the shared prefix's blocks
    run(s)
    assert s.block_manager.num_free_blocks == 64


def test_an_evicted_early_block_ends_the_prefix_hit_there():
    """Hits go left to right and each is checked: a prefix whose first block was evicted is no hit."""
    s = make_scheduler(64)
    prompt = list(range(300, 340))
    s.add_request(make_request("first", prompt))
    run(s)
    bm = s.block_manager
    first_block = bm.find_cached_prefix(make_request("probe", prompt))[0]
    bm._evict(first_block)
    assert bm.find_cached_prefix(make_request("probe", prompt)) == []


def test_a_decode_reservation_holds_only_the_prompts_last_window():
    s = Scheduler(BlockManager(64, BLOCK, sliding_window=WINDOW), role=Role.DECODE, max_model_len=4096)
    request = make_request("a", list(range(50)), max_tokens=5)
    assert s.reserve_for_remote_prefill(request)
    skipped = out_of_window_blocks(50, BLOCK, WINDOW)
    assert skipped == 10
    assert request.block_ids[:skipped] == [PLACEHOLDER] * skipped and request.num_released_blocks == skipped
    assert num_held(request.block_ids) == 13 - skipped == s.block_manager.num_used_blocks
    s.finish_kv_import("a", 7)
    run(s)
    assert s.block_manager.num_free_blocks == 64


def test_preempting_a_windowed_request_frees_only_what_it_holds():
    s = make_scheduler(64)
    request = make_request("a", list(range(50)), max_tokens=30)
    s.add_request(request)
    for _ in range(6):
        step(s)
    assert request.num_released_blocks > 0
    out = s.schedule()
    s._preempt(request, out)
    assert request.block_ids == [] and request.num_released_blocks == 0
    assert s.block_manager.num_free_blocks == 64


def test_the_router_validates_and_reserves_by_the_window():
    """12 blocks of 4 tokens: a 50-token prompt + 6 out is refused without a window, accepted
    under an 8-token one; the decode side is predicted to reserve the prompt's last window."""
    from disagg.config import ServingConfig
    from disagg.router.orchestrator import Orchestrator
    from disagg.router.validation import ModelLimits, check_fits, max_tokens_that_fit

    params = SamplingParams(temperature=0, max_tokens=6)
    whole = ModelLimits(vocab_size=512, max_model_len=4096, max_blocks_per_request=12, block_size=BLOCK)
    with pytest.raises(InvalidRequestError):
        check_fits(50, params, whole)
    windowed = ModelLimits(512, 4096, 12, BLOCK, sliding_window=WINDOW, chunk_tokens=16)
    check_fits(50, params, windowed)
    assert max_tokens_that_fit(50, whole) == 12 * BLOCK - 50
    assert max_tokens_that_fit(50, windowed) == 4096 - 50
    orchestrator = Orchestrator(ServingConfig(), None, None, None, BLOCK, sliding_window=WINDOW)
    assert orchestrator.blocks_reserved(50, 50) == 13 - out_of_window_blocks(50, BLOCK, WINDOW) == 3
