"""A worker's request link with the real worker class (no Ray: the actor class is plain Python
until the launcher wraps it): a router that goes away mid-request gets that request aborted on
the worker, its blocks freed, while the worker keeps serving others; a call for the role the
worker does not hold is refused over the link; a worker switches roles with its weights and
serves in the new one."""

from __future__ import annotations

import asyncio
import time

import pytest

from disagg.config import EngineConfig, Role, WorkerConfig
from disagg.errors import RemoteError
from disagg.kv_transfer.layout import KVLayout
from disagg.request import SamplingParams
from disagg.rpc.client import RpcClient
from disagg.rpc.stubs import DecodeStub, PrefillStub
from disagg.worker.actor import WorkerActor

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
    actor = WorkerActor(WorkerConfig("colo-link", Role.COLOCATED, EngineConfig(**{**MODEL, "num_kv_blocks": 128})))
    yield actor
    asyncio.run(actor.shutdown())


@pytest.fixture
def prefill():
    actor = WorkerActor(WorkerConfig("prefill-link", Role.PREFILL, EngineConfig(max_num_batched_tokens=16, **MODEL)))
    yield actor
    asyncio.run(actor.shutdown())


class Counter:
    """A router's link listener: the tokens each link brought; `finished` once "stays" ended."""

    def __init__(self, tokens: dict, finished: asyncio.Event):
        self.tokens, self.finished = tokens, finished

    def link_event(self, link, topic, deltas):
        for delta in deltas:
            self.tokens[link] += len(delta.token_ids)
            if delta.finished and link == "stays":
                self.finished.set()

    def link_lost(self, link):
        pass


def test_a_router_that_goes_away_mid_stream_leaves_no_block_behind(colocated):
    engine = colocated.role.engine
    total = engine.num_total_blocks

    async def scenario():
        tokens = {"stays": 0, "leaves": 0}
        finished = asyncio.Event()
        stays, leaves = (
            RpcClient(colocated.rpc.address, colocated.config.link_key, name, listener=Counter(tokens, finished))
            for name in ("stays", "leaves")
        )
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
    engine = prefill.role.engine
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


def test_a_call_for_the_role_the_worker_does_not_hold_is_refused_over_the_link(prefill):
    """One check refuses it, with a clear error (UNAVAILABLE: the router places elsewhere); the
    worker serves on in its role."""
    engine = prefill.role.engine

    async def scenario():
        client = RpcClient(prefill.rpc.address, prefill.config.link_key, name="prefill-link")
        params = SamplingParams(temperature=0.0, max_tokens=4)
        with pytest.raises(RemoteError, match="serves prefill now: DecodeRole.reserve refused") as refused:
            await DecodeStub(client).reserve("r", [1, 2, 3], params, KVLayout.single("p", "x:1"), 5.0, timeout_s=5)
        assert refused.value.grpc_code_name == "UNAVAILABLE"
        with pytest.raises(RemoteError, match="DecodeRole.submit refused"):
            await DecodeStub(client).submit("s", [1, 2, 3], params, timeout_s=5)
        first = await PrefillStub(client).prefill("p1", list(range(1, 20)), params)
        assert (await asyncio.wait_for(first, 30)).num_prompt_tokens == 19
        assert set(engine.scheduler.requests) == {"p1"}  # its KV held for its targets; nothing of r or s
        assert await PrefillStub(client).abort("p1", timeout_s=5)
        await client.close()

    asyncio.run(scenario())
    assert wait_until(lambda: not engine.scheduler.requests and engine.num_free_blocks == engine.num_total_blocks)


def test_a_worker_switches_roles_with_its_weights_and_serves_in_the_new_one():
    """Every worker can switch (the default 1 + 1 deployment's too): decode -> prefill -> decode,
    the weights never reloaded; after a switch the old role's calls are refused; a worker that
    holds a request, or a colocated one, refuses to switch."""
    worker = WorkerActor(WorkerConfig("switching", Role.DECODE, EngineConfig(**{**MODEL, "num_kv_blocks": 128})))
    engine = worker.role.engine
    weights = [p.data_ptr() for p in engine.model.parameters()]
    decode_address = worker.role.address()

    async def scenario():
        client = RpcClient(worker.rpc.address, worker.config.link_key, name="switching")
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        await DecodeStub(client).submit("busy", list(range(1, 20)), params, timeout_s=5)
        with pytest.raises(ValueError, match="drain"):
            await worker.switch_role("prefill")
        await DecodeStub(client).abort("busy", timeout_s=5)
        assert await worker.switch_role("prefill")
        assert worker.instance_info().role == "prefill" and worker.role.address() != decode_address
        with pytest.raises(RemoteError, match="serves prefill now"):
            await DecodeStub(client).submit("s", [1, 2, 3], params, timeout_s=5)
        first = await PrefillStub(client).prefill("p", list(range(1, 20)), SamplingParams(max_tokens=2))
        assert (await asyncio.wait_for(first, 30)).num_prompt_tokens == 19
        await PrefillStub(client).abort("p", timeout_s=5)
        assert await worker.switch_role("decode") and worker.instance_info().role == "decode"
        await client.close()

    try:
        asyncio.run(scenario())
        assert worker.role.engine is engine and [p.data_ptr() for p in engine.model.parameters()] == weights
    finally:
        asyncio.run(worker.shutdown())
    colocated = WorkerActor(WorkerConfig("colo-switch", Role.COLOCATED, EngineConfig(**MODEL)))
    try:
        with pytest.raises(ValueError, match="only prefill and decode switch"):
            asyncio.run(colocated.switch_role("prefill"))
    finally:
        asyncio.run(colocated.shutdown())
