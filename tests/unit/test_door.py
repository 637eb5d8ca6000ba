"""The door (issue 52): a request over a frontend's in-flight bound is refused before the serving
loop spends anything on it, RESOURCE_EXHAUSTED by gRPC's own call loop (maximum_concurrent_rpcs)
and 429 by the HTTP API's middleware, neither reaching its handler; the admitted requests stream
on, and once they end new requests are admitted again (also after a second flood: grpc.aio's
count must not drift as its refusals end).

Real frontends (grpc.aio, aiohttp) and the real request path on a loop of their own, in front
of a stand-in router whose requests stream a token every few ms until cancelled."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import grpc
import pytest

from disagg.config import ServingConfig
from disagg.metrics import ServingMetrics
from disagg.router import grpc_door
from disagg.router.frontend import ServingServicer
from disagg.router.grpc_door import GENERATE, frontend_server
from disagg.router.grpc_service import add_serving_service
from disagg.router.http_frontend import HttpFrontend
from disagg.router.request_path import RequestPath
from disagg.router.validation import ModelLimits
from disagg.rpc.messages import TokenDelta
from disagg.slo import SLO
from disagg.v1 import serving_pb2, serving_pb2_grpc

LIMIT = 4
FLOOD = 20
MODEL = "stand-in"
CORE_REFUSAL = "Concurrent RPC limit exceeded!"


class StreamingRouter:
    """The orchestrator's face to the request path: every request streams a token every 5 ms."""

    def __init__(self, limit: int):
        self.config = ServingConfig(max_inflight_requests=limit, http_port=0)
        self.default_slo = SLO(0.0, 0.0)

    async def generate(self, request_id, prompt_token_ids, params, slo=None, priority="standard", received_at=None):
        while True:
            yield TokenDelta(request_id, [1], text="a", num_output_tokens=1)
            await asyncio.sleep(0.005)


class CountingServicer(ServingServicer):
    """Counts the Generate calls that reach the servicer."""

    entered = 0

    async def Generate(self, request, context):
        CountingServicer.entered += 1
        async for response in super().Generate(request, context):
            yield response


class CountingHttp(HttpFrontend):
    """Counts the generations that reach the handler."""

    entered = 0

    async def completions(self, request):
        CountingHttp.entered += 1
        return await super().completions(request)


class Frontend:
    """Both frontends over one request path, on a loop of their own in a background thread."""

    def __init__(self):
        router = StreamingRouter(LIMIT)
        limits = ModelLimits(vocab_size=1000, max_model_len=4096, max_blocks_per_request=1000, block_size=16)
        self.path = RequestPath(router, None, limits, ServingMetrics(), None)
        self.config = router.config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "Frontend":
        self.thread.start()
        self.run(self._start())
        return self

    def run(self, coro, timeout_s: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    async def _start(self) -> None:
        CountingServicer.entered = CountingHttp.entered = 0
        self.grpc_server = frontend_server(self.path, self.config)
        add_serving_service(CountingServicer(self.path, None, MODEL), self.grpc_server)
        port = self.grpc_server.add_insecure_port("127.0.0.1:0")
        await self.grpc_server.start()
        self.grpc_address = f"127.0.0.1:{port}"
        self.http = CountingHttp(self.path, None, self.config, MODEL)
        self.http_url = f"http://{await self.http.start()}"

    def __exit__(self, *exc) -> None:
        async def stop():
            await self.grpc_server.stop(grace=None)
            await self.http.stop()

        self.run(stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture
def frontend(monkeypatch):
    monkeypatch.setattr(grpc_door, "CONTROL_CALLS", 0)  # gRPC's limit is the bound itself: exact counts
    with Frontend() as running:
        yield running


def grpc_request() -> serving_pb2.GenerateRequest:
    return serving_pb2.GenerateRequest(
        prompt_token_ids=serving_pb2.TokenIds(ids=[1, 2, 3]), sampling=serving_pb2.SamplingParams(max_tokens=1000)
    )


def grpc_flood(stub, count: int) -> tuple[list, list]:
    """`count` Generate calls at once: (the admitted, streaming; the refusals' (code, details))."""
    calls = [stub.Generate(grpc_request(), timeout=30) for _ in range(count)]
    admitted, refused = [], []
    for call in calls:
        try:
            assert len(next(call).token_ids) == 1
            admitted.append(call)
        except grpc.RpcError as exc:
            refused.append((exc.code(), exc.details()))
    return admitted, refused


def test_grpc_refuses_over_the_bound_before_the_servicer_and_serves_the_rest(frontend):
    with grpc.insecure_channel(frontend.grpc_address) as channel:
        stub = serving_pb2_grpc.ServingStub(channel)
        for flood in range(2):  # the second: after the first's refusals ended, the count is right
            admitted, refused = grpc_flood(stub, LIMIT + FLOOD)
            assert len(admitted) == LIMIT and refused == [(grpc.StatusCode.RESOURCE_EXHAUSTED, CORE_REFUSAL)] * FLOOD
            assert CountingServicer.entered == LIMIT * (flood + 1), "a refused call reached the servicer"
            for call in admitted:  # each streams on
                assert sum(len(next(call).token_ids) for _ in range(3)) == 3
            for call in admitted:
                call.cancel()
            wait_idle(frontend)


def test_every_generate_is_told_to_the_request_path_as_it_arrives(frontend):
    """Those gRPC refuses too: the burst they make holds the admitted requests' work back."""
    before = frontend.path.arrivals.count
    with grpc.insecure_channel(frontend.grpc_address) as channel:
        admitted, refused = grpc_flood(serving_pb2_grpc.ServingStub(channel), LIMIT + FLOOD)
        for call in admitted:
            call.cancel()
    assert frontend.path.arrivals.count - before == LIMIT + FLOOD
    assert GENERATE == "/disagg.v1.Serving/Generate"


def test_http_refuses_over_the_bound_with_429_before_the_handler_and_serves_the_rest(frontend):
    async def flood() -> tuple[int, list[int]]:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1000, "stream": True}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as session:
            streams = [await session.post(f"{frontend.http_url}/v1/completions", json=body) for _ in range(LIMIT)]
            assert [r.status for r in streams] == [200] * LIMIT
            entered = CountingHttp.entered
            refusals = await asyncio.gather(
                *(session.post(f"{frontend.http_url}/v1/completions", json=body) for _ in range(FLOOD))
            )
            statuses = [r.status for r in refusals]
            assert all(r.headers["Retry-After"] for r in refusals)
            for response in streams:  # each streams on
                for _ in range(3):
                    assert (await asyncio.wait_for(next_event(response), 10)).startswith(b"data: {")
                response.close()
            return CountingHttp.entered - entered, statuses

    reached, statuses = asyncio.run(flood())
    assert statuses == [429] * FLOOD and reached == 0, "a refused request reached the handler"
    wait_idle(frontend)
    with grpc.insecure_channel(frontend.grpc_address) as channel:  # and it serves again
        admitted, refused = grpc_flood(serving_pb2_grpc.ServingStub(channel), 1)
        assert len(admitted) == 1 and not refused
        admitted[0].cancel()


async def next_event(response) -> bytes:
    while True:
        line = (await response.content.readline()).strip()
        if line:
            return line


def wait_idle(frontend: Frontend, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while frontend.path._active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not frontend.path._active
    time.sleep(0.2)  # grpc.aio counts a call until its task is done, a turn or two after
