"""The OpenAI-compatible HTTP API against gRPC on the same requests, one server, one run (issue 37).

`disagg serve` (the default deployment: 1 prefill + 1 decode instance of the default model, gRPC
and HTTP on 127.0.0.1) in its own process. Closed-loop clients (`--streams` of them) send
greedy requests (random prompt token ids, EOS ignored) back to back, streamed: over gRPC
(`Generate`) and over HTTP (`POST /v1/completions`, server-sent events), in alternating rounds
so that drift on the machine falls on both alike. Prints, per number of streams: TTFT p50 of
each API and their ratio (HTTP / gRPC, target <= 1.05), and output tokens per second of each and
their ratio (HTTP / gRPC, target >= 0.95).

    PYTHONPATH=. .venv/bin/python loadtest/bench_http.py [--streams 1 16] [--requests 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc

from disagg.bench.experiment import free_port
from disagg.client import generate_request
from disagg.v1 import serving_pb2_grpc
from loadtest.served import Deployment, add_config_argument

MODEL = "smollm2-135m-instruct"


async def grpc_one(stub, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    started, first, tokens = time.perf_counter(), None, 0
    request = generate_request(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for msg in stub.Generate(request, timeout=300):
        if msg.token_ids and first is None:
            first = time.perf_counter()
        tokens += len(msg.token_ids)
    return first - started, tokens


async def http_one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    started, first, tokens = time.perf_counter(), None, 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            chunk = json.loads(text[6:])
            if chunk.get("choices") and first is None:  # (a token's text may be empty: a partial character)
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (first or time.perf_counter()) - started, tokens


async def closed_loop(send, prompts: list[list[int]], streams: int, max_tokens: int) -> tuple[list[float], float]:
    """`streams` clients taking the prompts in turn; (TTFTs, output tokens per second)."""
    queue = list(prompts)
    ttfts, tokens = [], 0

    async def client():
        nonlocal tokens
        while queue:
            ttft, n = await send(queue.pop(), max_tokens)
            ttfts.append(ttft)
            tokens += n

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    return ttfts, tokens / (time.perf_counter() - started)


async def measure(grpc_address: str, http_url: str, args) -> dict:
    rng = random.Random(0)
    results = {}
    async with grpc.aio.insecure_channel(grpc_address) as channel, aiohttp.ClientSession() as session:
        stub = serving_pb2_grpc.ServingStub(channel)
        apis = {
            "grpc": lambda prompt, n: grpc_one(stub, prompt, n),
            "http": lambda prompt, n: http_one(session, http_url, prompt, n),
        }
        for streams in args.streams:
            seen = {api: ([], []) for api in apis}  # TTFTs, throughputs
            for _ in range(args.rounds):
                for api, send in apis.items():
                    prompts = [
                        [rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.requests)
                    ]
                    ttfts, throughput = await closed_loop(send, prompts, streams, args.max_tokens)
                    seen[api][0].extend(ttfts)
                    seen[api][1].append(throughput)
            results[streams] = {
                api: {"ttft_p50_ms": statistics.median(t) * 1e3, "tokens_per_s": statistics.mean(s)}
                for api, (t, s) in seen.items()
            }
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=48, help="per API, round and number of streams")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    add_config_argument(p)
    args = p.parse_args(argv)
    http_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        dep = Deployment(Path(tmp), args.config, http_port=http_port, calibration_s=0, max_inflight_requests=64)
        try:
            results = asyncio.run(measure(dep.address, f"http://127.0.0.1:{http_port}", args))
        finally:
            dep.stop()
    for streams, by_api in results.items():
        g, h = by_api["grpc"], by_api["http"]
        print(f"{streams} streams: TTFT p50 ms grpc {g['ttft_p50_ms']:.1f}, http {h['ttft_p50_ms']:.1f}")
        print(f"{streams} streams: ttft p50 ratio http/grpc: {h['ttft_p50_ms'] / g['ttft_p50_ms']:.3f}")
        print(f"{streams} streams: tokens/s grpc {g['tokens_per_s']:.1f}, http {h['tokens_per_s']:.1f}")
        print(f"{streams} streams: throughput ratio http/grpc: {h['tokens_per_s'] / g['tokens_per_s']:.3f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
