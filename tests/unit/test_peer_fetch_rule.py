"""Peer block fetch without a model: the router's rule (fetch a prefix when moving its blocks is
predicted faster than computing them) and the block manager's pins, slots and registration."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from disagg.engine.block_manager import BlockManager
from disagg.engine.kv_cache import KVCache
from disagg.engine.kv_tiers.host_tier import HostTier
from disagg.engine.kv_tiers.index_events import IndexEvents
from disagg.engine.kv_tiers.tiered_store import TieredStore
from disagg.placement.latency_model import Coefficients, StepModel
from disagg.placement.peer_fetch import FetchRate, plan_fetch, saved_prefill_ms
from disagg.request import Request, SamplingParams

BS = 16
MODEL = StepModel(Coefficients(5.0, 0.1, 1e-4), Coefficients(3.0, 0.001, 0.2), Coefficients(3.0, 0.001, 0.2))
HASHES = list(range(100, 164))  # a 1,025-token prompt's 64 full blocks
PROMPT = 64 * BS + 1
BLOCK_BYTES = 64 * 1024


@dataclass
class Held:
    instance_id: str
    blocks: int

    def cached_tokens(self, block_hashes) -> int:
        return min(self.blocks, len(block_hashes)) * BS


def plan(prefill, holders, rate=FetchRate(1e9, 5.0), model=MODEL):
    return plan_fetch(prefill, model, holders, HASHES, PROMPT, BS, BLOCK_BYTES, rate)


def test_the_holder_of_the_most_blocks_is_fetched_from_when_that_is_faster():
    prefill = Held("p0", 8)
    chosen = plan(prefill, [prefill, Held("d0", 40), Held("p1", 60), Held("d1", 20)])
    assert chosen.holder.instance_id == "p1" and (chosen.own_blocks, chosen.num_blocks, chosen.extra_blocks) == (
        8,
        60,
        52,
    )
    # 52 blocks of 64 KiB at 1 GB/s plus 5 ms, against their 832 tokens' prefill at 0.1 ms a token and more
    assert chosen.transfer_ms == pytest.approx(5.0 + 52 * BLOCK_BYTES / 1e6)
    assert chosen.saved_ms == pytest.approx(saved_prefill_ms(MODEL, PROMPT, 8 * BS, 60 * BS)) and chosen.saved_ms > 83


def test_no_fetch_when_no_peer_holds_more_or_the_transfer_is_no_faster():
    prefill = Held("p0", 30)
    assert plan(prefill, [Held("d0", 30), Held("d1", 10)]) is None  # nobody holds more
    assert plan(prefill, [Held("d0", 31)], rate=FetchRate(1e9, 50.0)) is None  # one block is not worth 50 ms
    assert plan(prefill, [Held("d0", 64)], rate=FetchRate(1e6, 0.0)) is None  # 2 MiB at 1 MB/s: 2 s
    assert plan(prefill, [Held("d0", 64)], rate=FetchRate(1e9, 0.0)) is not None


def test_the_saving_is_the_prefill_of_the_fetched_tokens_with_their_attention():
    # The intercept is paid either way; the tokens' term and their attention's are saved.
    assert saved_prefill_ms(MODEL, 1000, 0, 0) == 0
    assert saved_prefill_ms(MODEL, 1000, 0, 512) == pytest.approx(0.1 * 512 + 1e-4 * 512**2)
    assert saved_prefill_ms(MODEL, 1000, 256, 512) == pytest.approx(0.1 * 256 + 1e-4 * (512**2 - 256**2))
    with pytest.raises(ValueError):
        FetchRate(0.0, 1.0)


def cache_prompt(bm: BlockManager, tokens: list[int]) -> None:
    request = Request("warm", tokens, SamplingParams())
    assert bm.allocate_slots(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(request)
    bm.free(request)


def test_a_pinned_prefix_survives_other_allocations_until_unpinned():
    tokens = list(range(3, 3 + 4 * BS))
    bm = BlockManager(6, BS)
    cache_prompt(bm, tokens)
    assert bm.pin_cached_prefix(tokens, 5) is None  # it holds 4 full blocks, not 5
    assert bm.pin_cached_prefix([9] + tokens[1:], 1) is None  # other tokens: no hit
    pinned = bm.pin_cached_prefix(tokens, 3)
    assert len(pinned) == 3 and bm.num_free_blocks == 3
    other = Request("other", list(range(500, 500 + 3 * BS)), SamplingParams())
    assert bm.allocate_slots(other, 3 * BS)  # takes the free blocks, the unpinned cached one among them
    assert not set(pinned) & set(other.block_ids)
    assert bm.cached_run(tokens, 4) == pinned  # the 4th block was reused: the run ends before it
    bm.unpin(pinned)
    bm.free(other)
    assert bm.num_free_blocks == 6


def test_an_import_slot_skips_what_is_held_and_registers_the_rest_under_their_hashes():
    tokens = list(range(3, 3 + 5 * BS + 1))
    bm = BlockManager(8, BS)
    cache_prompt(bm, tokens[: 2 * BS])
    held, table = bm.reserve_prefix_import(tokens, 5)
    assert held == 2 and len(table) == 5 and bm.num_free_blocks == 3
    assert bm.cached_run(tokens, 5) == table[:2]  # the fresh blocks are not in the cache yet
    bm.finish_prefix_import(tokens, table)
    assert bm.cached_run(tokens, 5) == table and bm.num_free_blocks == 8
    request = Request("next", tokens, SamplingParams())
    assert bm.find_cached_prefix(request) == table  # a prefill of the prompt hits them all
    assert bm.reserve_prefix_import(tokens, 5) is None  # nothing missing now


def test_an_import_slot_that_fails_gives_every_block_back_uncached():
    tokens = list(range(3, 3 + 4 * BS))
    bm = BlockManager(4, BS)
    assert bm.reserve_prefix_import(tokens, 5) is None  # more blocks than the prompt has
    held, table = bm.reserve_prefix_import(tokens, 4)
    assert held == 0 and bm.num_free_blocks == 0
    assert bm.reserve_prefix_import(list(range(900, 900 + 2 * BS)), 1) is None  # no room left
    bm.unpin(table)
    assert bm.num_free_blocks == 4 and bm.cached_run(tokens, 4) == []


def test_a_prefix_only_the_host_tier_holds_is_loaded_back_and_pinned_bit_exact():
    cache = KVCache(1, 4, BS, 1, 4, torch.float32, torch.device("cpu"))
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=torch.Generator().manual_seed(0)))
    bm = BlockManager(4, BS, lower=TieredStore(cache, HostTier(1 << 20), None, IndexEvents(100)))
    tokens = list(range(3, 3 + 2 * BS))
    cache_prompt(bm, tokens)
    kv = cache.export_blocks(bm.cached_run(tokens, 2))
    cache_prompt(bm, list(range(500, 500 + 4 * BS)))  # every block reused: the prompt's go down a tier
    assert bm.cached_run(tokens, 2) == []
    pinned = bm.pin_cached_prefix(tokens, 2)
    assert pinned is not None and cache.export_blocks(pinned).equal(kv)
    assert bm.pin_cached_prefix(list(range(900, 900 + 2 * BS)), 2) is None  # nowhere: nothing taken
    bm.unpin(pinned)
    assert bm.num_free_blocks == 4
