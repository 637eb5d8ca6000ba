"""A worker's request link with the real worker classes (no Ray: the actor classes are plain
Python until the launcher wraps them): a router that goes away mid-request gets that request
aborted on the worker, its blocks freed, while the worker keeps serving others."""

from __future__ import annotations

import asyncio
import time

import pytest

from disagg.config import EngineConfig, Role, WorkerConfig
from disagg.decode_worker.actor import DecodeActor
from disagg.prefill_worker.actor import PrefillActor
from disagg.request import SamplingParams
from disagg.rpc.client import RpcClient
from disagg.rpc.stubs import DecodeStub, PrefillStub

MODEL = dict(model="random:tiny", num_kv_blocks=64, num_threads=1)


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def colocated():
    actor = DecodeActor(WorkerConfig("colo-link", Role.COLOCATED, EngineConfig(**{**MODEL, "num_kv_blocks": 128})))
    yield actor
    asyncio.run(actor.shutdown())


@pytest.fixture
def prefill():
    actor = PrefillActor(WorkerConfig("prefill-link", Role.PREFILL, EngineConfig(max_num_batched_tokens=16, **MODEL)))
    yield actor
    asyncio.run(actor.shutdown())


def test_a_router_that_goes_away_mid_stream_leaves_no_block_behind(colocated):
    engine = colocated.worker.engine
    total = engine.num_total_blocks

    async def scenario():
        stays, leaves = (RpcClient(colocated.rpc.address, colocated.config.link_key) for _ in range(2))
        tokens = {"stays": 0, "leaves": 0}
        finished = asyncio.Event()

        def counter(name):
            def on_event(topic, deltas):
                for delta in deltas:
                    tokens[name] += len(delta.token_ids)
                    if delta.finished and name == "stays":
                        finished.set()

            return on_event

        stays.on_event, leaves.on_event = counter("stays"), counter("leaves")
        params = SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True)  # far longer than the test
        await DecodeStub(leaves).submit("gone", list(range(1, 40)), params, timeout_s=10)
        await DecodeStub(stays).submit(
            "kept", list(range(1, 20)), SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), timeout_s=10
        )
        while tokens["leaves"] < 3:
            await asyncio.sleep(0.01)
        await leaves.close()  # the router process died, say
        await asyncio.wait_for(finished.wait(), 30)  # the other router's request still completes
        assert tokens["stays"] == 60
        await stays.close()

    asyncio.run(scenario())
    assert wait_until(lambda: not engine.has_unfinished_requests() and engine.num_free_blocks == total, 0.5)


def test_a_prefill_whose_router_went_away_is_aborted(prefill):
    engine = prefill.worker.engine
    total = engine.num_total_blocks

    async def scenario():
        client = RpcClient(prefill.rpc.address, prefill.config.link_key)
        params = SamplingParams(temperature=0.0, max_tokens=8)
        first = await PrefillStub(client).prefill("p1", list(range(1, 200)), params)  # 13 steps of 16 tokens
        while not engine.scheduler.requests:
            await asyncio.sleep(0.001)
        await client.close()
        with pytest.raises(Exception):
            await asyncio.wait_for(first, 5)

    asyncio.run(scenario())
    assert wait_until(lambda: not engine.scheduler.requests and engine.num_free_blocks == total, 2.0)


def test_an_actor_refuses_a_worker_config_of_another_role():
    with pytest.raises(ValueError, match="role"):
        PrefillActor(WorkerConfig("p-wrong", Role.DECODE, EngineConfig(**MODEL)))
    with pytest.raises(ValueError, match="role"):
        DecodeActor(WorkerConfig("d-wrong", Role.PREFILL, EngineConfig(**MODEL)))
