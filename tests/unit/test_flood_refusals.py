"""A flood beyond the in-flight bound is refused at once, over gRPC and HTTP (issue 40).

The real frontends (gRPC's servicer on grpc.aio, the HTTP API on aiohttp) and the real request
path, on an event loop of their own on 127.0.0.1, in front of a stand-in router whose requests
each hold the loop for `START_S` when they start, as tokenizing, placement and the workers' calls
do, then stream a token every few ms until cancelled. `LIMIT` of them fill the bound; the flood
of `LIMIT + REFUSED` requests at once must have its refusals answered before the admitted
requests' start-up (LIMIT * START_S of the loop's time), the admitted streams must go on, and the
server must serve once they end. Before the fix, each refusal came after all of that start-up.
"""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import grpc
import pytest

from disagg.config import ServingConfig
from disagg.metrics import ServingMetrics
from disagg.slo import SLO
from disagg.router.arrivals import Arrivals
from disagg.router.frontend import ServingServicer
from disagg.router.grpc_door import frontend_server
from disagg.router.grpc_service import add_serving_service
from disagg.router.http_frontend import HttpFrontend
from disagg.router.request_path import RequestPath
from disagg.router.validation import ModelLimits
from disagg.rpc.messages import TokenDelta
from disagg.v1 import serving_pb2, serving_pb2_grpc

LIMIT = 8
REFUSED = 56
START_S = 0.1  # the loop's time each admitted request takes to start: 0.8 s for the bound's worth
# Every refusal within half the admitted start-up: before the fix, the first came after all of it.
REFUSED_WITHIN_S = LIMIT * START_S / 2
MODEL = "stand-in"
# The burst's start scaled to this stand-in's start-up (100 ms, where the service's takes a few):
# arrivals 1 s apart still make a burst.
TEST_START_GAP_S = 1.0


class SlowStartRouter:
    """The orchestrator's face to the request path: each request blocks the event loop for
    `start_s` at its start (time.sleep: the loop is held, as by the real start-up's Python), then
    streams one token every `token_s` until cancelled."""

    def __init__(self, limit: int, start_s: float, token_s: float = 0.005):
        self.config = ServingConfig(max_inflight_requests=limit, http_port=0)
        self.default_slo = SLO(0.0, 0.0)
        self.start_s = start_s
        self.token_s = token_s

    async def generate(self, request_id, prompt_token_ids, params, slo=None, priority="standard", received_at=None):
        time.sleep(self.start_s)
        while True:
            yield TokenDelta(request_id, [1], text="a", num_output_tokens=1)
            await asyncio.sleep(self.token_s)


class Frontends:
    """Both frontends over one request path, on a loop of their own in a background thread."""

    def __init__(self, router: SlowStartRouter):
        limits = ModelLimits(vocab_size=1000, max_model_len=4096, max_blocks_per_request=1000, block_size=16)
        self.path = RequestPath(router, None, limits, ServingMetrics(), None)
        self.path.arrivals = Arrivals(start_gap_s=TEST_START_GAP_S, burst_min=2)
        self.config = router.config
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.grpc_address = self.http_url = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "Frontends":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=30)
        return self

    async def _start(self) -> None:
        self.grpc_server = frontend_server(self.path, self.config)
        add_serving_service(ServingServicer(self.path, None, MODEL), self.grpc_server)
        port = self.grpc_server.add_insecure_port("127.0.0.1:0")
        await self.grpc_server.start()
        self.grpc_address = f"127.0.0.1:{port}"
        self.http = HttpFrontend(self.path, None, self.config, MODEL)
        self.http_url = f"http://{await self.http.start()}"

    def __exit__(self, *exc) -> None:
        async def stop():
            await self.grpc_server.stop(grace=None)
            await self.http.stop()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def in_flight(self) -> int:
        return len(self.path._active)

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.in_flight() == 0, f"{self.in_flight()} requests still in flight after the flood"


@pytest.fixture
def frontends():
    with Frontends(SlowStartRouter(LIMIT, START_S)) as running:
        yield running


def grpc_request(max_tokens: int = 1000) -> serving_pb2.GenerateRequest:
    return serving_pb2.GenerateRequest(
        prompt_token_ids=serving_pb2.TokenIds(ids=[1, 2, 3]), sampling=serving_pb2.SamplingParams(max_tokens=max_tokens)
    )


def test_a_grpc_flood_is_refused_at_once_while_the_admitted_stream_on(frontends):
    with grpc.insecure_channel(frontends.grpc_address) as channel:
        stub = serving_pb2_grpc.ServingStub(channel)
        refusals, lock, started = [], threading.Lock(), time.perf_counter()

        def on_done(call):
            with lock:
                refusals.append((time.perf_counter() - started, call.code()))

        calls = []
        for _ in range(LIMIT + REFUSED):
            call = stub.Generate(grpc_request(), timeout=30)
            call.add_done_callback(on_done)
            calls.append(call)
        deadline = time.monotonic() + 20
        while len(refusals) < REFUSED and time.monotonic() < deadline:
            time.sleep(0.01)
        with lock:
            ended = list(refusals)
        assert len(ended) == REFUSED and {code for _, code in ended} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        slowest = max(seconds for seconds, _ in ended)
        assert slowest < REFUSED_WITHIN_S, f"the last refusal took {slowest:.3f} s"
        admitted = [call for call in calls if not call.done()]
        assert len(admitted) == LIMIT
        for call in admitted:  # each streams on: three tokens more
            assert sum(len(next(call).token_ids) for _ in range(3)) == 3
        for call in admitted:
            call.cancel()
    frontends.wait_idle()
    serves_after(frontends)


def test_an_http_flood_is_429_at_once_while_the_admitted_stream_on(frontends):
    async def flood():
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1000, "stream": True}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:
            refused, streams = [], []

            async def one():
                started = time.perf_counter()
                response = await session.post(f"{frontends.http_url}/v1/completions", json=body)
                if response.status == 429:
                    refused.append(time.perf_counter() - started)
                    response.release()
                    return
                assert response.status == 200
                streams.append(response)

            # aiohttp reads requests that come together in one turn: the flood's tail comes just
            # after its head, as it does from many clients, while the head's requests start.
            head = [asyncio.create_task(one()) for _ in range(LIMIT)]
            await asyncio.sleep(0.02)
            await asyncio.gather(*head, *(one() for _ in range(REFUSED)))
            assert len(refused) == REFUSED and len(streams) == LIMIT
            for response in streams:  # each streams on: three events more
                events = [await asyncio.wait_for(_next_event(response), 10) for _ in range(3)]
                assert all(event.startswith("data: {") for event in events)
                response.close()
            return max(refused)

    slowest = asyncio.run(flood())
    assert slowest < REFUSED_WITHIN_S, f"the last 429 took {slowest:.3f} s"
    frontends.wait_idle()
    serves_after(frontends)


async def _next_event(response) -> str:
    while True:
        line = (await response.content.readline()).decode().strip()
        if line:
            return line


def serves_after(frontends: Frontends) -> None:
    """A new request is admitted and streams, once the flood's streams have ended."""
    with grpc.insecure_channel(frontends.grpc_address) as channel:
        call = serving_pb2_grpc.ServingStub(channel).Generate(grpc_request(), timeout=30)
        assert len(next(call).token_ids) == 1
        call.cancel()
