"""Refusals under a flood (issue 40): how long a request the in-flight bound refuses waits for
its refusal, when many more clients arrive at once than the server admits.

Starts `disagg serve` (the default deployment: 1 prefill + 1 decode worker of the default model,
gRPC and HTTP on 127.0.0.1, no SLO) with `max_inflight_requests` at `--limit`, then opens
`--clients` streaming requests at once from this process (asyncio gRPC calls over `--channels`
connections, or with `--http` streamed `POST /v1/completions`). Each asks for `--max-tokens`
tokens with EOS ignored, so that the admitted ones hold their places while the others are
refused. Measured on the client: from a call's start to its RESOURCE_EXHAUSTED (HTTP 429).
The admitted streams are cancelled once every call is decided (refused, ended, or streaming)
or after `--hold-s`; then one short request checks that the server still serves. `refused`
and its percentiles count the in-flight bound's refusals; a request admitted beyond what the
decode side runs waits for room there and may be refused later, at the admission timeout
(30 s by default): those are counted apart, `refused once admitted`.

The same is run first at `--baseline-clients` against `--baseline-limit` (a deployment of its
own), the flood that was already answered fast. `--frontends N`: the deployment runs N frontends
(ServingConfig.frontends), each admitting its share of the bound, and the gRPC connections are
spread over them.

    .venv/bin/python -m loadtest.faults.flood [--clients 768] [--limit 256] [--http]

The last lines are `clients: N`, `limit: L`, `refused: R`, `refusal p50 ms: X`,
`refusal p99 ms: X`, `refusal max ms: X`, `target p99 <= 100 ms: met|missed`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import grpc

from disagg.bench.launcher import Deployment, add_config_argument
from disagg.bench.results import host_line, write_results
from disagg.client import api_key_metadata, generate_request
from disagg.v1 import serving_pb2_grpc

PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
MODEL = "smollm2-135m-instruct"
TARGET_P99_MS = 100.0
CALL_TIMEOUT_S = 120.0  # no call outlives this, whatever the server does


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=768)
    p.add_argument("--limit", type=int, default=256, help="the server's max_inflight_requests")
    p.add_argument("--baseline-clients", type=int, default=64)
    p.add_argument("--baseline-limit", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1024, help="long: the admitted hold their places")
    p.add_argument("--hold-s", type=float, default=45.0, help="the admitted are cancelled after this at most")
    p.add_argument("--channels", type=int, default=8, help="gRPC connections the clients are spread over")
    p.add_argument("--http", action="store_true", help="the OpenAI-compatible HTTP API instead of gRPC")
    p.add_argument(
        "--frontends", type=int, default=1, help="frontends of the deployment; gRPC clients spread over them"
    )
    p.add_argument("--json", default="loadtest/out/bench_flood.json")
    add_config_argument(p)
    return p.parse_args(argv)


# What the in-flight bound's refusals say: the request path's, and gRPC's own past its
# maximum_concurrent_rpcs (disagg.router.grpc_door).
BOUND_REFUSALS = ("requests in flight", "Concurrent RPC limit exceeded")


@dataclass
class Flood:
    """What the calls of one flood came to, as they are decided."""

    clients: int
    refused_ms: list[float] = field(default_factory=list)  # call start -> refused by the in-flight bound
    # Refused later, once admitted: no room on the decode side within the admission timeout.
    refused_later_ms: list[float] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)  # every call: refused, streaming, ended, or a code
    decided: int = 0
    all_decided: asyncio.Event = field(default_factory=asyncio.Event)

    def decide(self, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.decided += 1
        if self.decided >= self.clients:
            self.all_decided.set()

    def refused(self, started: float, message: str) -> None:
        at_door = any(refusal in message for refusal in BOUND_REFUSALS)
        (self.refused_ms if at_door else self.refused_later_ms).append((time.perf_counter() - started) * 1e3)
        self.decide("refused" if at_door else "refused later")


# ---- gRPC clients -----------------------------------------------------------------------------------
async def grpc_call(stub, flood: Flood, release: asyncio.Event, max_tokens: int) -> None:
    """One client: refused, or streaming until `release` (its place held), then cancelled."""
    request = generate_request(PROMPT, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    call = stub.Generate(request, timeout=CALL_TIMEOUT_S, metadata=api_key_metadata())
    decided = False
    try:
        async for _ in call:
            if not decided:
                decided = True
                flood.decide("streaming")
                await _wait(release)  # the rest of the stream is not read: gRPC's flow control holds it
                call.cancel()
                return
        if not decided:
            flood.decide("ended")
    except grpc.aio.AioRpcError as exc:
        if decided:
            return
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            flood.refused(started, exc.details() or "")
        else:
            flood.decide(exc.code().name)


async def grpc_flood(addresses: list[str], clients: int, max_tokens: int, hold_s: float, channels: int) -> Flood:
    # Separate connections (a local subchannel pool each), as separate clients would open, spread
    # over the frontends.
    options = [("grpc.use_local_subchannel_pool", 1)]
    count = max(len(addresses), channels)
    opened = [grpc.aio.insecure_channel(addresses[i % len(addresses)], options=options) for i in range(count)]
    try:
        for channel in opened:
            await asyncio.wait_for(channel.channel_ready(), 30)
        stubs = [serving_pb2_grpc.ServingStub(channel) for channel in opened]
        return await run_flood(clients, hold_s, lambda i, f, r: grpc_call(stubs[i % len(stubs)], f, r, max_tokens))
    finally:
        for channel in opened:
            await channel.close(grace=None)


# ---- HTTP clients -----------------------------------------------------------------------------------
async def http_call(session, url: str, flood: Flood, release: asyncio.Event, max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    started = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status == 429:
                flood.refused(started, (await response.json())["error"]["message"])
                return
            if response.status != 200:
                flood.decide(f"HTTP {response.status}")
                return
            await response.content.readline()  # the first event: admitted and streaming
            flood.decide("streaming")
            await _wait(release)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        flood.decide(type(exc).__name__)


async def http_flood(url: str, clients: int, max_tokens: int, hold_s: float) -> Flood:
    connector = aiohttp.TCPConnector(limit=0)  # every client its own connection, at once
    timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await run_flood(clients, hold_s, lambda i, f, r: http_call(session, url, f, r, max_tokens))


# ---- one flood ----------------------------------------------------------------------------------------
async def run_flood(clients: int, hold_s: float, call) -> Flood:
    """`clients` calls at once; the admitted are let go once all are decided, or after `hold_s`."""
    flood, release = Flood(clients), asyncio.Event()
    tasks = [asyncio.create_task(call(i, flood, release)) for i in range(clients)]
    try:
        await asyncio.wait_for(flood.all_decided.wait(), hold_s)
    except asyncio.TimeoutError:
        pass
    release.set()
    _, pending = await asyncio.wait(tasks, timeout=30)
    for task in pending:  # still undecided: neither refused nor streaming within hold_s
        task.cancel()
    flood.outcomes["undecided"] += len(pending)
    await asyncio.gather(*tasks, return_exceptions=True)
    return flood


async def _wait(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), CALL_TIMEOUT_S)


async def serves_after(address: str) -> str:
    """One short request after the flood: "yes" when it gets its tokens, else what it got."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = serving_pb2_grpc.ServingStub(channel)
        request = generate_request(PROMPT, temperature=0.0, max_tokens=4, ignore_eos=True)
        tokens = 0
        try:
            async for msg in stub.Generate(request, timeout=60, metadata=api_key_metadata()):
                tokens += len(msg.token_ids)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return "yes" if tokens == 4 else f"{tokens} tokens of 4"


# ---- a run: a deployment, its flood, the check after -----------------------------------------------
def run(args, clients: int, limit: int) -> dict:
    settings = {"max_inflight_requests": limit, "frontends": args.frontends}
    with Deployment(settings, base=args.config, name="flood", http=args.http) as dep:
        if args.http:
            flood = asyncio.run(http_flood(dep.http_url, clients, args.max_tokens, args.hold_s))
        else:
            flood = asyncio.run(
                grpc_flood(dep.frontend_addresses, clients, args.max_tokens, args.hold_s, args.channels)
            )
        time.sleep(2)  # the cancelled streams' cleanup on the workers
        serving = asyncio.run(serves_after(dep.address))
    return summary(clients, limit, flood, serving)


def summary(clients: int, limit: int, flood: Flood, serving: str) -> dict:
    times, later = sorted(flood.refused_ms), sorted(flood.refused_later_ms)
    return {
        "clients": clients, "limit": limit, "refused": len(times),
        "p50_ms": percentile(times, 0.50), "p99_ms": percentile(times, 0.99), "max_ms": times[-1] if times else None,
        "refused_later": len(later), "refused_later_max_ms": later[-1] if later else None,
        "all_refusals_p99_ms": percentile(sorted(times + later), 0.99),
        "outcomes": dict(flood.outcomes), "serves_after": serving,
        "refused_ms": [round(t, 1) for t in times], "refused_later_ms": [round(t, 1) for t in later],
    }  # fmt: skip


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def report(result: dict, prefix: str = "") -> None:
    def ms(value):
        return "-" if value is None else f"{value:.1f}"

    print(f"{prefix}outcomes: {result['outcomes']}")
    print(
        f"{prefix}refused once admitted (no decode room in time): {result['refused_later']}, "
        f"max {ms(result['refused_later_max_ms'])} ms; p99 of every refusal {ms(result['all_refusals_p99_ms'])} ms"
    )
    print(f"{prefix}serves after the flood: {result['serves_after']}")
    print(f"{prefix}clients: {result['clients']}")
    print(f"{prefix}limit: {result['limit']}")
    print(f"{prefix}refused: {result['refused']}")
    print(f"{prefix}refusal p50 ms: {ms(result['p50_ms'])}")
    print(f"{prefix}refusal p99 ms: {ms(result['p99_ms'])}")
    print(f"{prefix}refusal max ms: {ms(result['max_ms'])}")


def main(argv=None) -> int:
    args = parse_args(argv)
    print(host_line(), flush=True)
    api = "HTTP" if args.http else "gRPC"
    print(f"baseline: {args.baseline_clients} {api} clients against {args.baseline_limit}", flush=True)
    baseline = run(args, args.baseline_clients, args.baseline_limit)
    print(f"flood: {args.clients} {api} clients against {args.limit}", flush=True)
    flood = run(args, args.clients, args.limit)
    write_results(args.json, {"baseline": baseline, "flood": flood}, args)
    report(baseline, "baseline ")
    report(flood)
    met = flood["p99_ms"] is not None and flood["p99_ms"] <= TARGET_P99_MS
    print(f"target p99 <= {TARGET_P99_MS:.0f} ms: {'met' if met else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
