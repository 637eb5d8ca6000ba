"""Multi-turn chats against prefix caching as today and with KV tiers + the prefix index (issue 54).

Sessions of --turns turns: a turn's prompt is the previous prompt, its answer and a new message,
so that each turn's prefix is the whole conversation so far. Sessions start in an open loop at
--session-rate per second (a session's turns follow each other, each sent when the last answer
ends); the run stops when every session has ended. The same sessions run twice, each against a
deployment of its own (127.0.0.1): prefix caching as today (no tier under the pool, no index, no
decode-side reuse), then with the host tier and the cluster-wide index (the defaults).
--mode colocated: one colocated instance of the default model; --mode disaggregated: one prefill
and one decode instance, where the new run also lets a turn's new tokens be prefilled on the
decode instance that holds its history (decode-side reuse, `decode_reuse_max_tokens`).
--pool-fraction sizes the KV pool (disaggregated: the prefill pool's; the decode pool holds every
session's running request) to that fraction of the KV of all the conversations at their end, so
that a conversation's blocks are evicted before its next turn.

Prints TTFT p50 / p90 by turn for both, the hit rate by tier, and as its last lines
`multi-turn ttft p50 ratio: N` (turns 4 on, with tiers against today's) and
`multi-turn hit rate: N` (prompt tokens served from cache, with tiers, turns 2 on).

    .venv/bin/python -m loadtest.kv.multi_turn [--sessions 8] [--pool-fraction 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import urllib.request

from disagg.bench.launcher import Deployment, add_config_argument
from disagg.bench.load_client import GrpcApi, LoadRequest, new_record
from disagg.bench.metrics import RequestRecord
from disagg.bench.results import host_line
from disagg.client import generate_request

BLOCK_SIZE = 16
VOCAB = 49_152  # the default model's (SmolLM2): random ids below it, past its special tokens
TODAY = {"kv_host_tier_bytes": 0, "kv_index_max_events": 0}
TODAY_PLACEMENT = {"decode_reuse_max_tokens": 0}  # decode-side reuse off
FROM_TURN = 4  # the turns the ratio compares: those whose prefix is long
METRICS_SETTLE_S = 2.0  # a heartbeat, then the frontend's gauges refresh


def messages(args) -> list[list[list[int]]]:
    """Each session's messages, its first prompt first: the same in both runs."""
    rng = random.Random(args.seed)
    sizes = [args.first_tokens] + [args.message_tokens] * (args.turns - 1)
    return [[[rng.randrange(100, VOCAB) for _ in range(n)] for n in sizes] for _ in range(args.sessions)]


async def session(api, index: int, its_messages, args, zero: float) -> list[RequestRecord]:
    await asyncio.sleep(max(0.0, zero + index / args.session_rate - time.perf_counter()))
    prompt, records = [], []
    for turn, message in enumerate(its_messages):
        prompt = prompt + message
        request = LoadRequest(
            generate_request(prompt_token_ids=prompt, temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True),
            len(prompt),
        )
        record = await api.send(request, new_record(index * args.turns + turn, request), zero, lane=index)
        if not record.success:
            raise SystemExit(f"session {index} turn {turn + 1} failed: {record.error_code} {record.error}")
        records.append(record)
        prompt = prompt + record.token_ids
    return records


async def run_sessions(address: str, all_messages, args) -> list[list[RequestRecord]]:
    async with GrpcApi(address, connections=1, timeout_s=args.request_timeout_s) as api:
        zero = time.perf_counter()
        return await asyncio.gather(*(session(api, i, m, args, zero) for i, m in enumerate(all_messages)))


def pool_blocks(args) -> int:
    """KV blocks for --pool-fraction of every conversation's KV at its end, at least two whole
    conversations (one running, one more)."""
    per_conversation = conversation_blocks(args)
    return max(int(args.pool_fraction * args.sessions * per_conversation), 2 * per_conversation)


def conversation_blocks(args) -> int:
    """KV blocks of a whole conversation at its end."""
    final = args.first_tokens + (args.turns - 1) * args.message_tokens + args.turns * args.answer_tokens
    return -(-final // BLOCK_SIZE) + 1


def settings(args, tiers: bool) -> dict:
    engine = {"num_kv_blocks": pool_blocks(args), "block_size": BLOCK_SIZE, "max_num_batched_tokens": 512}
    engine.update({"kv_host_tier_bytes": args.host_tier_mib << 20} if tiers else TODAY)
    common = {"engine": engine, "heartbeat_interval_s": 0.3, "heartbeat_ttl_s": 1.5}
    if args.mode == "colocated":
        return {
            **common,
            "mode": "colocated",
            "colocated": {"num_instances": 1, "num_cpus_per_worker": 1},
            "calibration_s": 0,
        }
    pool = {"num_instances": 1, "num_cpus_per_worker": 1}
    # The decode pool holds every session's running request (each may decode at once; a pool
    # too small refuses them), so only the prefill pool is held to --pool-fraction.
    decode = {**pool, "engine": {"num_kv_blocks": max(pool_blocks(args), args.sessions * conversation_blocks(args))}}
    return {
        **common,
        "mode": "disaggregated",
        "prefill": pool,
        "decode": decode,
        **({} if tiers else TODAY_PLACEMENT),
    }


def measure(args, all_messages, tiers: bool):
    """Each session's records, and the instance's tier figures at the end."""
    with Deployment(settings(args, tiers), base=args.config, name="tiers" if tiers else "today") as dep:
        sessions = asyncio.run(run_sessions(dep.address, all_messages, args))
        time.sleep(METRICS_SETTLE_S)  # the last heartbeat reaches the metrics
        text = urllib.request.urlopen(dep.metrics_url, timeout=10).read().decode()
    return sessions, {t: tier_hits(text, t) for t in ("pool", "host")} | {"peer": peer_fetched(text)}


def tier_hits(metrics_text: str, tier: str) -> float:
    """`disagg:kv_tier_hit_blocks_total` of `tier`, every instance together."""
    lines = metrics_text.splitlines()
    prefix, label = "disagg:kv_tier_hit_blocks_total{", f'tier="{tier}"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix) and label in line)


def peer_fetched(metrics_text: str) -> float:
    """`disagg:kv_peer_fetched_blocks_total`: blocks prefill instances fetched from a peer."""
    prefix = "disagg:kv_peer_fetched_blocks_total"
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines() if line.startswith(prefix))


def decode_side_share(sessions) -> float:
    """The share of later turns prefilled by the instance that decodes them (decode-side reuse)."""
    later = [r for s in sessions for r in s[1:]]
    local = [r for r in later if r.server.get("prefill_instance") == r.server.get("decode_instance")]
    return len(local) / max(1, len(later))


def by_turn(sessions) -> list[list[float]]:
    return [[s[turn].ttft for s in sessions] for turn in range(len(sessions[0]))]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def hit_rate(sessions) -> float:
    later = [r for s in sessions for r in s[1:]]
    prompt = sum(r.server.get("prompt_tokens", 0) for r in later)
    return sum(r.server.get("cached_prompt_tokens", 0) for r in later) / max(1, prompt)


def report(today, tiers, hits, mode: str) -> None:
    print("turn  prompt  today p50/p90 ms  tiers p50/p90 ms")
    for turn, (a, b) in enumerate(zip(by_turn(today), by_turn(tiers)), start=1):
        prompt = tiers[0][turn - 1].prompt_len
        print(
            f"{turn:4}  {prompt:6}  {statistics.median(a) * 1e3:7.0f} / {quantile(a, 0.9) * 1e3:5.0f}"
            f"  {statistics.median(b) * 1e3:7.0f} / {quantile(b, 0.9) * 1e3:5.0f}"
        )
    later = slice(FROM_TURN - 1, None)
    ratio = statistics.median([t for turn in by_turn(tiers)[later] for t in turn]) / statistics.median(
        [t for turn in by_turn(today)[later] for t in turn]
    )
    print(f"hit rate today: {hit_rate(today):.2f}")
    print(
        f"hit blocks with tiers: {hits['pool']:.0f} taken from the pool, {hits['host']:.0f} loaded into it from the host tier"
    )
    if mode == "disaggregated":
        print(f"later turns prefilled on their decode instance: {decode_side_share(tiers):.2f}")
        print(f"blocks prefill instances fetched from a peer: {hits['peer']:.0f}")
    print(f"multi-turn ttft p50 ratio: {ratio:.2f}")
    print(f"multi-turn hit rate: {hit_rate(tiers):.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("colocated", "disaggregated"), default="colocated")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--session-rate", type=float, default=1.0, help="sessions started per second")
    p.add_argument("--first-tokens", type=int, default=256, help="tokens of a session's first prompt")
    p.add_argument("--message-tokens", type=int, default=64, help="tokens of each later message")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--pool-fraction", type=float, default=0.25, help="KV pool: this fraction of all conversations")
    p.add_argument("--host-tier-mib", type=int, default=512)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    add_config_argument(p)
    args = p.parse_args(argv)
    if args.turns < FROM_TURN or args.sessions < 1 or args.session_rate <= 0 or not 0 < args.pool_fraction <= 1:
        p.error(f"need --turns >= {FROM_TURN}, --sessions >= 1, --session-rate > 0, 0 < --pool-fraction <= 1")
    print(host_line(), flush=True)
    print(f"{args.mode}: sessions {args.sessions} x {args.turns} turns, KV pool {pool_blocks(args)} blocks", flush=True)
    all_messages = messages(args)
    today, _ = measure(args, all_messages, tiers=False)
    tiers, hits = measure(args, all_messages, tiers=True)
    report(today, tiers, hits, args.mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
