"""KV tiers under the pool: an evicted block goes down and comes back bit-exact."""

from __future__ import annotations

import torch

from disagg.engine.block_manager import BlockManager
from disagg.engine.kv_cache import KVCache
from disagg.engine.kv_tiers.disk_tier import DiskTier
from disagg.engine.kv_tiers.host_tier import HostTier
from disagg.engine.kv_tiers.index_events import DROP, STORE, IndexEvents
from disagg.engine.kv_tiers.tiered_store import TieredStore
from disagg.request import Request, SamplingParams

BS = 4


def _cache(num_blocks: int = 4) -> KVCache:
    return KVCache(2, num_blocks, BS, 2, 8, torch.float32, torch.device("cpu"))


def _block_bytes(cache: KVCache) -> int:
    return cache.slice_bytes(cache.num_layers, (0, cache.num_kv_heads), 1)


def _computed(bm: BlockManager, cache: KVCache, request_id: str, tokens: list[int]) -> Request:
    """A request whose prompt is computed: its blocks allocated, filled with random KV, cached."""
    request = Request(request_id, tokens, SamplingParams())
    cached = bm.find_cached_prefix(request)
    assert bm.allocate_slots(request, len(tokens) - len(cached) * BS, cached)
    fresh = request.block_ids[len(cached) :]
    cache.tensor[:, :, :, fresh] = torch.randn(cache.tensor[:, :, :, fresh].shape)
    request.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(request)
    return request


def _tiered(cache: KVCache, host_blocks: int, disk_dir=None, disk_blocks: int = 0):
    disk = None if disk_dir is None else DiskTier(str(disk_dir), disk_blocks * _block_bytes(cache))
    store = TieredStore(cache, HostTier(host_blocks * _block_bytes(cache)), disk, IndexEvents(100))
    return store, BlockManager(cache.num_blocks, BS, lower=store)


def _evict_everything(bm: BlockManager, cache: KVCache) -> None:
    """Another prompt takes every block (the cached ones are evicted), writes garbage, leaves."""
    other = Request("other", list(range(1000, 1000 + cache.num_blocks * BS)), SamplingParams())
    assert bm.allocate_slots(other, cache.num_blocks * BS)
    cache.tensor.fill_(float("nan"))
    bm.free(other)


def test_a_block_evicted_to_the_host_tier_comes_back_bit_exact():
    cache = _cache()
    store, bm = _tiered(cache, host_blocks=8)
    first = _computed(bm, cache, "a", list(range(9)))  # two full blocks cached, a third partial
    original = cache.export_blocks(first.block_ids[:2]).clone()
    bm.free(first)
    _evict_everything(bm, cache)
    again = Request("b", list(range(9)), SamplingParams())
    hits = bm.find_cached_prefix(again)
    assert len(hits) == 2
    assert torch.equal(cache.export_blocks(hits), original)
    assert store.stats.hit_blocks["host"] == 2 and store.stats.loaded_bytes["host"] == 2 * _block_bytes(cache)


def test_the_disk_tier_takes_what_the_host_tier_drops(tmp_path):
    cache = _cache()
    store, bm = _tiered(cache, host_blocks=1, disk_dir=tmp_path / "kv", disk_blocks=4)
    first = _computed(bm, cache, "a", list(range(9)))
    original = cache.export_blocks(first.block_ids[:2]).clone()
    bm.free(first)
    _evict_everything(bm, cache)
    assert len(store.disk.blocks) == 1 and len(list((tmp_path / "kv").iterdir())) == 1
    hits = bm.find_cached_prefix(Request("b", list(range(9)), SamplingParams()))
    assert torch.equal(cache.export_blocks(hits), original)
    assert store.stats.hit_blocks["disk"] == 1 and store.stats.hit_blocks["host"] == 1


def test_without_tiers_an_evicted_block_is_recomputed():
    cache = _cache()
    bm = BlockManager(cache.num_blocks, BS)
    bm.free(_computed(bm, cache, "a", list(range(9))))
    _evict_everything(bm, cache)
    assert bm.find_cached_prefix(Request("b", list(range(9)), SamplingParams())) == []


def test_a_block_with_other_tokens_under_the_same_hash_is_a_miss():
    cache = _cache()
    store, bm = _tiered(cache, host_blocks=8)
    bm.free(_computed(bm, cache, "a", list(range(9))))
    _evict_everything(bm, cache)
    (block_hash,) = [h for h, _ in store.tier_hashes()][:1]
    assert store.fetch(block_hash, (9, 9, 9, 9)) is None


def test_the_index_hears_every_move():
    cache = _cache()
    store, bm = _tiered(cache, host_blocks=1)
    bm.free(_computed(bm, cache, "a", list(range(9))))
    _evict_everything(bm, cache)
    events = [(e.kind, e.tier) for e in store.events.drain(100)]
    # cached in the pool twice, then down: the first to the host, pushed out by the second
    assert events == [(STORE, "pool"), (STORE, "pool"), (STORE, "host"), (STORE, "host"), (DROP, "host")]


def test_a_full_event_queue_loses_the_oldest_and_says_so():
    events = IndexEvents(2)
    for h in range(3):
        events.stored(h, "pool")
    assert events.overflowed and [e.block_hash for e in events.drain(10)] == [1, 2]
