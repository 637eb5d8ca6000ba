"""The one load client (disagg.bench.load_client) and the capacity helper against stand-in
servers on 127.0.0.1: a real grpc.aio server speaking the public API's `Generate`, and a real
aiohttp server streaming OpenAI completions. Each streams `max_tokens` tokens a few ms apart, so
that the loops' schedules, concurrency and timings can be checked against what was sent.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from aiohttp import web

from disagg.bench.capacity import measure_capacity
from disagg.bench.load_client import (
    GrpcApi,
    HttpApi,
    LoadRequest,
    closed_loop,
    http_body,
    open_loop,
    run_loop,
)
from disagg.client import generate_request
from disagg.slo import SLO
from disagg.v1 import serving_pb2, serving_pb2_grpc

TOKEN_S = 0.01


class StandIn(serving_pb2_grpc.ServingServicer):
    """Streams tokens 100, 101, ... one a message; refuses a prompt "refuse"; counts who is in flight."""

    def __init__(self, refuse_all: bool = False):
        self.in_flight = self.most_in_flight = 0
        self.seen: list[serving_pb2.GenerateRequest] = []
        self.refuse_all = refuse_all

    async def Generate(self, request, context):
        self.seen.append(request)
        if request.prompt == "refuse" or self.refuse_all:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many")
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            n = request.sampling.max_tokens
            for i in range(n):
                await asyncio.sleep(TOKEN_S)
                last = i == n - 1
                yield serving_pb2.GenerateResponse(
                    request_id=request.request_id or f"server-{len(self.seen)}",
                    token_ids=[100 + i],
                    text=f"t{i} ",
                    finished=last,
                    finish_reason="length" if last else "",
                    usage=serving_pb2.Usage(prompt_tokens=3, completion_tokens=n) if last else None,
                )
        finally:
            self.in_flight -= 1


async def with_grpc(test) -> None:
    """`test(api, stand_in)` against a stand-in gRPC server."""
    server, stand_in = grpc.aio.server(), StandIn()
    serving_pb2_grpc.add_ServingServicer_to_server(stand_in, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with GrpcApi(f"127.0.0.1:{port}") as api:
            await test(api, stand_in)
    finally:
        await server.stop(None)


def requests(n: int, max_tokens: int = 4) -> list[LoadRequest]:
    return [LoadRequest(generate_request(f"prompt {i}", max_tokens=max_tokens, ignore_eos=True), 3) for i in range(n)]


def test_a_closed_loop_keeps_its_streams_busy_and_times_every_token():
    async def test(api, stand_in):
        run = await closed_loop(api, requests(6), streams=2)
        assert [r.index for r in run.records] == list(range(6)) and all(r.success for r in run.records)
        assert stand_in.most_in_flight == 2
        first = run.records[0]
        assert first.token_ids == [100, 101, 102, 103] and first.output_len == 4 and first.text == "t0 t1 t2 t3 "
        assert first.ttft >= TOKEN_S and first.tpot == pytest.approx((first.e2el - first.ttft) / 3)
        assert len(first.token_times) == 4 and first.token_times == sorted(first.token_times)
        assert first.request_id.startswith("server-")  # the server's name where we gave none
        # three rounds of two requests, each about four tokens long
        assert run.duration_s >= 3 * 4 * TOKEN_S

    asyncio.run(with_grpc(test))


def test_a_closed_loop_with_a_stop_cycles_its_requests_until_told():
    async def test(api, stand_in):
        done = []
        run = await closed_loop(
            api, requests(2, max_tokens=2), streams=1, until=lambda: len(done.append(1) or done) > 5
        )
        assert len(run.records) == 5 and {r.prompt for r in stand_in.seen} == {"prompt 0", "prompt 1"}

    asyncio.run(with_grpc(test))


def test_an_open_loop_sends_each_request_at_its_arrival_whatever_the_server_does():
    async def test(api, stand_in):
        arrivals = [0.0, 0.15, 0.3]
        run = await open_loop(api, requests(3, max_tokens=20), arrivals)  # each takes 0.2 s: they overlap
        assert [r.sent_at for r in run.records] == pytest.approx(arrivals, abs=0.05)
        assert stand_in.most_in_flight >= 2

    asyncio.run(with_grpc(test))


def test_a_concurrency_cap_holds_due_requests_and_a_refusal_is_a_record():
    async def test(api, stand_in):
        sent = [LoadRequest(generate_request("refuse", max_tokens=2)), *requests(3)]
        run = await open_loop(api, sent, [0.0] * 4, max_concurrency=1)
        assert stand_in.most_in_flight == 1
        refused, *served = run.records
        assert refused.error_code == "RESOURCE_EXHAUSTED" and not refused.success
        assert all(r.success for r in served)

    asyncio.run(with_grpc(test))


def test_the_capacity_is_the_completion_rate_at_saturation():
    async def test(api, stand_in):
        capacity = await measure_capacity(api, requests(8), streams=4)
        assert capacity.completed == 8 and capacity.streams == 4
        assert capacity.requests_per_s == pytest.approx(8 / capacity.duration_s)
        assert capacity.rate(0.5) == pytest.approx(capacity.requests_per_s / 2)
        assert "load 0.5 x capacity" in capacity.describe(0.5)

    asyncio.run(with_grpc(test))


def test_failover_sends_a_failed_request_once_more_through_the_next_frontend():
    async def test():
        servers, stand_ins, addresses = [], [StandIn(refuse_all=True), StandIn()], []
        for stand_in in stand_ins:
            server = grpc.aio.server()
            serving_pb2_grpc.add_ServingServicer_to_server(stand_in, server)
            addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
            await server.start()
            servers.append(server)
        try:
            async with GrpcApi(addresses, failover=True) as api:
                zero = time.perf_counter() - 5.0  # the caller's clock: times count from it
                run = await closed_loop(api, requests(2), streams=2, zero=zero)
        finally:
            for server in servers:
                await server.stop(None)
        first, second = run.records  # lane 0 through the refusing frontend, lane 1 through the other
        assert first.success and first.retried and first.server["frontend"] == addresses[1]
        assert second.success and not second.retried and second.server["frontend"] == addresses[1]
        assert len(stand_ins[0].seen) == 1 and first.sent_at >= 5.0

    asyncio.run(test())


# ---- the OpenAI-compatible API --------------------------------------------------------------------
def sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["prompt"] == "refuse":
        return web.json_response({"error": {"message": "too many", "code": "resource_exhausted"}}, status=429)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(body["max_tokens"]):
        await asyncio.sleep(TOKEN_S)
        await response.write(sse({"choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}]}))
    await response.write(sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}))
    await response.write(sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}}))
    await response.write(b"data: [DONE]\n\n")
    return response


async def models(request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "stand-in"}]})


async def with_http(test) -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with HttpApi(f"http://127.0.0.1:{port}") as api:
            await test(api)
    finally:
        await runner.cleanup()


def test_the_same_loop_over_http_times_chunks_and_counts_the_usage():
    async def test(api):
        assert api.model == "stand-in"
        sent = [LoadRequest(generate_request("refuse", max_tokens=2)), *requests(3, max_tokens=5)]
        run = await closed_loop(api, sent, streams=2)
        refused, *served = run.records
        assert refused.error_code == "RESOURCE_EXHAUSTED" and "too many" in refused.error
        for record in served:
            assert record.success and record.output_len == 5 and record.text == "t0 t1 t2 t3 t4 "
            assert record.ttft >= TOKEN_S and len(record.token_times) == 5

    asyncio.run(with_http(test))


def test_a_request_asks_the_http_api_what_it_asks_over_grpc():
    chat = generate_request(chat=[{"role": "user", "content": "hi"}], max_tokens=7, temperature=0.0, slo=SLO(500, 0))
    path, body = http_body(chat, "m")
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["max_tokens"] == 7 and body["temperature"] == 0.0 and body["slo"] == {"ttft_ms": 500.0}
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and "ignore_eos" not in body
    path, body = http_body(generate_request(prompt_token_ids=[5, 6], ignore_eos=True), "m")
    assert path == "/v1/completions" and body["prompt"] == [5, 6] and body["ignore_eos"] and "temperature" not in body


class PlainApi:
    """Any API the loops take: an async context manager that sends a request."""

    def __init__(self):
        self.opened = self.closed = False

    async def __aenter__(self):
        self.opened = True
        return self

    async def __aexit__(self, *exc):
        self.closed = True

    async def send(self, request, record, zero, lane=0):
        record.success, record.output_len = True, request.max_tokens
        return record


def test_run_loop_opens_the_api_around_a_loop_for_a_script_that_is_not_asynchronous():
    api = PlainApi()
    run = run_loop(api, closed_loop, requests(3), 2)
    assert api.opened and api.closed and [r.output_len for r in run.records] == [4, 4, 4]
