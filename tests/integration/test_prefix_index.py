"""The cluster-wide prefix index on a real Redis: published from the tiers' events, read by the
router's directory, rebuilt after Redis restarts, and never worse than a recompute when stale."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from disagg import LLM, SamplingParams
from disagg.cluster.redis_server import LocalRedis
from disagg.engine.block_manager import BlockManager
from disagg.engine.kv_cache import KVCache
from disagg.engine.kv_tiers.host_tier import HostTier
from disagg.engine.kv_tiers.index_events import IndexEvents
from disagg.engine.kv_tiers.tiered_store import TieredStore
from disagg.prefix_index import PrefixIndex
from disagg.registry import InstanceInfo, InstanceView, LoadReport, Registry
from disagg.request import Request
from disagg.router.directory import Instance, InstanceDirectory
from disagg.router.streams import DecodeStreams
from disagg.worker.prefix_publisher import PrefixPublisher

BS = 4


def _engine_view(num_blocks: int = 4):
    """What the publisher reads of an engine: its block manager and tiers (no model needed)."""
    cache = KVCache(1, num_blocks, BS, 1, 4, torch.float32, torch.device("cpu"))
    store = TieredStore(cache, HostTier(1 << 20), None, IndexEvents(1000))
    return SimpleNamespace(kv_tiers=store, block_manager=BlockManager(num_blocks, BS, lower=store))


def _cache_prompt(engine, tokens: list[int], request_id: str = "r") -> list[int]:
    request = Request(request_id, tokens, SamplingParams())
    assert engine.block_manager.allocate_slots(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    engine.block_manager.cache_full_blocks(request)
    engine.block_manager.free(request)
    return BlockManager.prompt_hashes(tokens, BS)


def test_the_index_follows_the_tiers_and_survives_a_redis_restart_by_republishing():
    engine = _engine_view()
    server = LocalRedis().start()
    try:
        index = PrefixIndex(server.url)
        publisher = PrefixPublisher(server.url, "i0", lambda: engine, 0.1, ttl_s=30)
        hashes = _cache_prompt(engine, list(range(9)))
        publisher.publish_once(index)
        assert index.read(["i0"])["i0"] == dict.fromkeys(hashes, "pool")
        _cache_prompt(engine, list(range(100, 116)), "other")  # takes every block: the first prompt's go down
        publisher.publish_once(index)
        assert {h: index.read(["i0"])["i0"][h] for h in hashes} == dict.fromkeys(hashes, "host")
        before = index.read(["i0"])["i0"]

        port = server.port
        server.stop()
        publisher.publish_once(index)  # Redis down: nothing published, nothing raised
        assert not publisher.report()["complete"]
        server = LocalRedis(port=port).start()  # back, empty
        assert index.read(["i0"])["i0"] == {}
        publisher.publish_once(index)
        assert index.read(["i0"])["i0"] == before
        assert publisher.num_republished == 2
    finally:
        server.stop()


def test_a_restarted_redis_is_noticed_without_any_failure_seen():
    engine = _engine_view()
    with LocalRedis() as server:
        index = PrefixIndex(server.url)
        publisher = PrefixPublisher(server.url, "i0", lambda: engine, 0.1, ttl_s=30)
        hashes = _cache_prompt(engine, list(range(9)))
        publisher.publish_once(index)
        Registry(server.url)._client.flushall()  # as a restart between two batches leaves it
        engine.kv_tiers.events.stored(12345, "pool")
        publisher.publish_once(index)
        assert set(hashes) <= set(index.read(["i0"])["i0"])


def _directory(redis_url: str) -> InstanceDirectory:
    return InstanceDirectory(
        Registry(redis_url), "test", b"k" * 32, DecodeStreams(), prefix_index=PrefixIndex(redis_url)
    )


def _instance(instance_id: str) -> Instance:
    info = InstanceInfo(instance_id, "colocated", "a", "", "random:tiny")
    return Instance(instance_id, "colocated", None, InstanceView(info, LoadReport(), 0.0), None, block_size=16)


def test_a_stale_index_entry_costs_a_recompute_not_an_error(redis_url):
    engine_args = dict(model="random:tiny", dtype="float32", num_kv_blocks=32, max_model_len=128)
    prompt = {"prompt_token_ids": list(range(3, 60))}
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    warm = LLM(**engine_args)
    publisher = PrefixPublisher(redis_url, "stale-0", lambda: warm.engine, 0.1, ttl_s=30)
    warm.generate([prompt], greedy, use_tqdm=False)
    publisher.publish_once(PrefixIndex(redis_url))
    directory = _directory(redis_url)
    directory._instances["stale-0"] = _instance("stale-0")
    asyncio.run(directory._read_prefix_index())
    hashes = BlockManager.prompt_hashes(prompt["prompt_token_ids"], 16)
    assert directory._instances["stale-0"].cached_tokens(hashes) == len(hashes) * 16  # the router thinks it warm
    # The instance restarts (or its blocks went) before the index hears of it: the entries are stale.
    cold = LLM(**engine_args)
    (out,) = cold.generate([prompt], greedy, use_tqdm=False)
    (fresh,) = LLM(**engine_args, enable_prefix_caching=False).generate([prompt], greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert out.num_cached_tokens == 0
    PrefixIndex(redis_url).forget("stale-0")
