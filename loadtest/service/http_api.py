"""The OpenAI-compatible HTTP API against gRPC on the same requests, one server, one run (issue 37).

`disagg serve` (the default deployment: 1 prefill + 1 decode instance of the default model, gRPC
and HTTP on 127.0.0.1) in its own process. Closed-loop clients (`--streams` of them) send
greedy requests (random prompt token ids, EOS ignored) back to back, streamed: over gRPC
(`Generate`) and over HTTP (`POST /v1/completions`, server-sent events), in alternating rounds
so that drift on the machine falls on both alike. Prints, per number of streams: TTFT p50 of
each API and their ratio (HTTP / gRPC, target <= 1.05), and output tokens per second of each and
their ratio (HTTP / gRPC, target >= 0.95).

    .venv/bin/python -m loadtest.service.http_api [--streams 1 16] [--requests 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys

from disagg.bench.launcher import Deployment, add_config_argument
from disagg.bench.load_client import GrpcApi, HttpApi, LoadRequest, LoadRun, closed_loop
from disagg.bench.results import host_line, write_results
from disagg.client import generate_request


def prompts(rng: random.Random, args) -> list[LoadRequest]:
    """Random prompt token ids (no prefix shared), greedy, EOS ignored."""
    out = []
    for _ in range(args.requests):
        ids = [rng.randrange(1000, 40000) for _ in range(args.prompt_len)]
        message = generate_request(prompt_token_ids=ids, max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        out.append(LoadRequest(message, len(ids)))
    return out


def served(run: LoadRun) -> LoadRun:
    """The run, every request of which must have been served (a failure ends the benchmark)."""
    failed = [r for r in run.records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, the first: {failed[0].error_code}: {failed[0].error}")
    return run


async def measure(dep: Deployment, args) -> dict:
    rng = random.Random(0)
    results = {}
    async with GrpcApi(dep.address, timeout_s=300) as grpc_api, HttpApi(dep.http_url, timeout_s=300) as http_api:
        apis = {"grpc": grpc_api, "http": http_api}
        for streams in args.streams:
            seen = {api: ([], []) for api in apis}  # TTFTs, throughputs
            for _ in range(args.rounds):
                for name, api in apis.items():
                    run = served(await closed_loop(api, prompts(rng, args), streams))
                    seen[name][0].extend(r.ttft for r in run.records)
                    seen[name][1].append(sum(r.output_len for r in run.records) / run.duration_s)
            results[streams] = {
                api: {"ttft_p50_ms": statistics.median(t) * 1e3, "tokens_per_s": statistics.mean(s)}
                for api, (t, s) in seen.items()
            }
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=48, help="per API, round and number of streams")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", help="write the figures here too")
    add_config_argument(p)
    args = p.parse_args(argv)
    print(host_line(), flush=True)
    with Deployment({"calibration_s": 0, "max_inflight_requests": 64}, base=args.config, http=True) as dep:
        results = asyncio.run(measure(dep, args))
    for streams, by_api in results.items():
        g, h = by_api["grpc"], by_api["http"]
        print(f"{streams} streams: TTFT p50 ms grpc {g['ttft_p50_ms']:.1f}, http {h['ttft_p50_ms']:.1f}")
        print(f"{streams} streams: ttft p50 ratio http/grpc: {h['ttft_p50_ms'] / g['ttft_p50_ms']:.3f}")
        print(f"{streams} streams: tokens/s grpc {g['tokens_per_s']:.1f}, http {h['tokens_per_s']:.1f}")
        print(f"{streams} streams: throughput ratio http/grpc: {h['tokens_per_s'] / g['tokens_per_s']:.3f}")
    if args.json:
        write_results(args.json, {"streams": results}, args)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
