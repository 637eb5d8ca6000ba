"""TP x PP sharded engines (one thread per rank, real gloo groups) generate exactly what one
unsharded engine generates: the model split, the all-reduce, the stage hand-off and the KV
cache slices are all exercised; only Ray is left out (tests/integration covers the actors)."""

from __future__ import annotations

from concurrent import futures
from datetime import timedelta

import pytest
import torch

from disagg.auth import AuthenticationError, new_key
from disagg.config import EngineConfig, ParallelConfig
from disagg.engine.distributed import RankPlace, join_instance
from disagg.engine.engine import LLMEngine
from disagg.engine.step_chunks import portable
from disagg.request import SamplingParams
from disagg.worker.instance_world import InstanceWorld, connect_world

PROMPTS = [[5, 9, 14, 3, 7], list(range(3, 60)), [11], [8, 2, 30, 41] * 9]


class ThreadRanks:
    """Rank 0's view of the other ranks: each runs its shard of a step on its own thread."""

    def __init__(self, num_ranks: int):
        self.engines: list[LLMEngine] = []  # built at the same time as rank 0's
        self.pool = futures.ThreadPoolExecutor(num_ranks)

    def submit(self, chunks):
        plain = portable(chunks)
        calls = [self.pool.submit(e.runner.execute_shard, plain) for e in self.engines]
        return _Pending(calls)


class _Pending:
    def __init__(self, calls):
        self.calls = calls

    def result(self):
        logits = [c.result(timeout=60) for c in self.calls]
        return next((x for x in logits if x is not None), None)


def sharded_engines(config: EngineConfig, tp: int, pp: int, enable_expert_parallel: bool = False) -> list[LLMEngine]:
    """Rank 0 serves the instance's world (as a worker does); the other ranks, threads here,
    connect to it with the key."""
    key = new_key()
    world = InstanceWorld("test-instance", key, "127.0.0.1")
    followers = ThreadRanks(tp * pp - 1)

    def build(rank: int) -> LLMEngine:
        place = RankPlace.of_rank(rank, tp, pp)
        parallel = ParallelConfig(tp, pp, place.tp_rank, place.pp_rank, enable_expert_parallel)
        store = world.store() if rank == 0 else connect_world(world.address, key)
        groups = join_instance(place, store, torch.device("cpu"), "127.0.0.1")
        return LLMEngine(config.replace(parallel=parallel), groups=groups, followers=followers if rank == 0 else None)

    with futures.ThreadPoolExecutor(tp * pp) as pool:
        engines = list(pool.map(build, range(tp * pp)))
    followers.engines = engines[1:]
    return engines


def greedy_tokens(engine: LLMEngine, max_tokens: int = 12) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt_token_ids=prompt, sampling_params=params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return [outputs[f"r{i}"] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_sharded_engine_matches_single(tiny_untied_dir, tp, pp):
    # A small budget chunks the long prompts, so chunked prefill crosses stages too.
    config = EngineConfig(
        model=tiny_untied_dir, dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=24
    )
    expected = greedy_tokens(LLMEngine(config))
    engines = sharded_engines(config, tp, pp)
    assert greedy_tokens(engines[0]) == expected
    assert engines[0].num_free_blocks == engines[0].num_total_blocks
    # Each rank holds only its slice of the KV: heads split by TP, layers by PP.
    rank_last = engines[-1]
    assert rank_last.kv_cache.tensor.shape[2] == 2 // tp
    assert rank_last.kv_cache.num_layers == (3 // pp if pp > 1 else 3)


def test_qkv_bias_shards_with_tp(tiny_qwen2_bias_dir):
    config = EngineConfig(model=tiny_qwen2_bias_dir, dtype="float32", device="cpu", num_kv_blocks=64)
    expected = greedy_tokens(LLMEngine(config), max_tokens=6)
    assert greedy_tokens(sharded_engines(config, 2, 1)[0], max_tokens=6) == expected


def test_engine_refuses_missing_groups(tiny_untied_dir):
    config = EngineConfig(
        model=tiny_untied_dir, dtype="float32", device="cpu", num_kv_blocks=8, parallel=ParallelConfig(2, 1)
    )
    with pytest.raises(ValueError, match="process groups"):
        LLMEngine(config)


def test_a_stranger_cannot_join_an_instances_world():
    """Rank 0's store answers only a caller that proves the deployment key: one with another key
    is refused before it reads or writes anything, and a plain TCPStore client gets nowhere."""
    key = new_key()
    world = InstanceWorld("guarded", key, "127.0.0.1")
    try:
        world.store().set("tp0/secret", b"address")
        with pytest.raises(AuthenticationError):
            connect_world(world.address, new_key())
        with pytest.raises(Exception):  # speaks TCPStore's protocol: no handshake, no answer
            torch.distributed.TCPStore(
                "127.0.0.1", world.address.port, is_master=False, timeout=timedelta(seconds=3)
            ).get("tp0/secret")
        assert connect_world(world.address, key).get("tp0/secret") == b"address"
    finally:
        world.close()
