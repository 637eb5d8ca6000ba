"""Cancel storm: requests ended mid-stream by client cancel, deadline or Abort, and what is left.

Starts `disagg serve` (the default deployment, 1 prefill + 1 decode worker, gRPC on 127.0.0.1)
with admission bounded at `--concurrency` requests, then `--concurrency` threads send `--total`
long requests (`--max-tokens`, EOS ignored), each ended one way, round robin: a client cancel,
a gRPC deadline that expires mid-stream, or the `Abort` RPC on a second connection. A third of
the cancels and aborts hit before the first token (after the response headers, so the server
holds the request: during prefill or KV transfer). Measured: outcome per way, Abort -> end of
stream latency, refusals during the storm, KV blocks still held on each pool, and whether
`--concurrency` fresh requests sent at once right after the storm, reusing ended requests' ids,
are refused (RESOURCE_EXHAUSTED or "already in flight/use": nothing is in flight any more, so
none should be). Table: `pre-token` counts requests that ended before their first token.

    .venv/bin/python -m loadtest.faults.cancel_storm --total 1000 --concurrency 16

The last lines are `ended: N`, `leaked blocks: N`, `abort to end p50 ms: X`, `refused after: N`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from collections import Counter

import grpc

from disagg.bench.launcher import Deployment, add_config_argument, held_blocks, leaked_blocks
from disagg.bench.results import host_line, write_results
from disagg.client import DisaggClient, generate_request

WAYS = ("cancel", "deadline", "abort")
INTENDED = {"cancel": "CANCELLED", "deadline": "DEADLINE_EXCEEDED", "abort": "abort"}
PROMPTS = ["Write a story about a dragon.", "Describe the ocean in detail.", "Tell me about ancient Rome."]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256, help="long enough to be streaming when ended")
    p.add_argument("--max-inflight", type=int, default=0, help="server admission bound; 0: --concurrency")
    p.add_argument("--ways", default=",".join(WAYS), help="which ways to end requests, round robin")
    p.add_argument("--pre-token-share", type=float, default=1 / 3, help="cancels/aborts before the first token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loadtest/out/cancel_storm.json")
    add_config_argument(p)
    return p.parse_args(argv)


def request(i: int, request_id: str, max_tokens: int):
    return generate_request(
        chat=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], request_id=request_id,
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
    )  # fmt: skip


class Storm:
    def __init__(self, client: DisaggClient, aborter: DisaggClient, args, ttft: float, itl: float):
        self.client, self.aborter, self.args, self.ttft, self.itl = client, aborter, args, ttft, itl
        self.lock = threading.Lock()
        self.records: list[dict] = []  # in the order the requests ended
        # RESOURCE_EXHAUSTED during the storm, by how the thread's previous request ended.
        self.refused: Counter[str] = Counter()

    def run(self, worker: int) -> None:
        last = "none"
        for i in range(worker, self.args.total, self.args.concurrency):
            for _ in range(100):  # refused: the server still counts an ended request; retry shortly
                rec = self.one(i)
                if rec["outcome"] != "RESOURCE_EXHAUSTED":
                    break
                with self.lock:
                    self.refused[last] += 1
                time.sleep(0.02)
            with self.lock:
                self.records.append(rec)
            last = rec["way"]

    def one(self, i: int) -> dict:
        rng = random.Random(self.args.seed * 1_000_003 + i)  # the same plan per request whatever the threads do
        ways = self.args.ways.split(",")
        way, rid = ways[i % len(ways)], f"storm-{self.args.seed}-{i}"
        pre = way != "deadline" and rng.random() < self.args.pre_token_share
        after = 0 if pre else rng.randint(1, 16)
        # Deadlines from before the first token to ~16 tokens in (measured unloaded; slower under load).
        # Others: 30 s, so that a stream that never ends (an Abort lost) shows as DEADLINE_EXCEEDED soon.
        timeout = rng.uniform(0.5 * self.ttft, self.ttft + 16 * self.itl) if way == "deadline" else 30
        rec = {"i": i, "id": rid, "way": way, "tokens": 0, "outcome": None, "abort_ms": None, "found": None}
        call, aborted_at = self.client.stream(request(i, rid, self.args.max_tokens), timeout=timeout), None
        try:
            if pre:
                call.initial_metadata()  # sent once the request is registered: it is in prefill / KV transfer now
                time.sleep(rng.uniform(0, self.ttft))
            elif way != "deadline":
                self.read(call, rec, after)
            if way == "cancel" and rec["outcome"] is None:
                call.cancel()
            elif way == "abort" and rec["outcome"] is None:
                aborted_at = time.perf_counter()
                rec["found"] = self.aborter.abort(rid)
            self.read(call, rec, None)
        except grpc.RpcError as exc:
            rec["outcome"], rec["detail"] = exc.code().name, (exc.details() or "")[:80]
        if aborted_at is not None:
            rec["abort_ms"] = (time.perf_counter() - aborted_at) * 1000
        return rec

    @staticmethod
    def read(call, rec: dict, until: int | None) -> None:
        """Stream messages until `until` tokens (None: the end); the last one's finish reason."""
        for msg in call:
            rec["tokens"] += len(msg.token_ids)
            if msg.finished:
                rec["outcome"] = msg.finish_reason
            if until is not None and rec["tokens"] >= until:
                return


def check_admission(client: DisaggClient, args, ids: list[str]) -> Counter:
    """`concurrency` requests at once, reusing ended requests' ids: every one should be served."""
    outcomes: Counter[str] = Counter()
    barrier, lock = threading.Barrier(len(ids)), threading.Lock()

    def send(k: int) -> None:
        barrier.wait()
        try:
            outcome = client.generate(request(k, ids[k], 8), timeout=120)[2].finish_reason
        except grpc.RpcError as exc:
            outcome = f"{exc.code().name}: {(exc.details() or '')[:80]}"
        with lock:
            outcomes[outcome] += 1

    threads = [threading.Thread(target=send, args=(k,)) for k in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    return outcomes


def seconds_to_zero(client: DisaggClient, since: float, limit_s: float = 120) -> float | None:
    """Seconds from `since` until no block is held anywhere (None: not within `limit_s`)."""
    while sum(held_blocks(client).values()):
        if time.monotonic() - since > limit_s:
            return None
        time.sleep(0.5)
    return round(time.monotonic() - since, 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    print(host_line(), flush=True)
    settings = {"max_inflight_requests": args.max_inflight or args.concurrency}
    with Deployment(settings, base=args.config, name="cancel-storm") as dep:
        with DisaggClient(dep.address) as client, DisaggClient(dep.address) as aborter:
            result = run(args, client, aborter)
    report(args, result)
    return 0


def run(args, client: DisaggClient, aborter: DisaggClient) -> dict:
    for _ in range(2):  # the second one warm: its TTFT and inter-token time size the deadlines
        last = client.generate(request(0, "", 32), timeout=300)[2]
    ttft, itl = last.timings.ttft_s, last.timings.decode_s / max(1, last.usage.completion_tokens - 1)
    storm, started = Storm(client, aborter, args, ttft, itl), time.monotonic()
    threads = [threading.Thread(target=storm.run, args=(w,), daemon=True) for w in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    storm_s, held_at_end = time.monotonic() - started, held_blocks(client)  # no wait: what cleanup is left
    ended = [r for r in storm.records if r["outcome"] == INTENDED[r["way"]]]
    check = check_admission(client, args, [r["id"] for r in ended[-args.concurrency :]])
    leaked = leaked_blocks(client)  # the shared measure (chaos.py too): still held after waiting up to 30 s
    return {
        "args": vars(args), "ttft_s": ttft, "itl_s": itl, "storm_s": round(storm_s, 1),
        "ended": len(ended), "refused_during": dict(storm.refused), "held_at_end": held_at_end,
        "check": dict(check), "leaked_blocks": leaked, "leaked_per_pool": held_blocks(client),
        "zero_after_s": seconds_to_zero(client, started + storm_s), "records": storm.records,
    }  # fmt: skip


def report(args, result: dict) -> None:
    records = result["records"]
    abort_ms = sorted(r["abort_ms"] for r in records if r["abort_ms"] is not None)
    result["abort_ms"], result["abort_not_found"] = None, sum(r["found"] is False for r in records)
    if abort_ms:
        p90 = abort_ms[int(0.9 * (len(abort_ms) - 1))]
        result["abort_ms"] = {
            k: round(v, 1) for k, v in (("p50", statistics.median(abort_ms)), ("p90", p90), ("max", abort_ms[-1]))
        }
    write_results(args.out, result)
    print(f"{'way':9} {'n':>5} {'pre-token':>9}  outcomes (code or finish_reason)")
    for way in WAYS:
        mine = [r for r in records if r["way"] == way]
        outcomes = Counter(r["outcome"] for r in mine)
        pre = sum(r["tokens"] == 0 for r in mine)
        print(f"{way:9} {len(mine):5} {pre:9}  {', '.join(f'{k} {v}' for k, v in outcomes.most_common())}")
    refused_after = sum(
        v for k, v in result["check"].items() if k.startswith("RESOURCE_EXHAUSTED") or "already in" in k
    )
    result["refused_after"] = refused_after
    print(
        f"storm {result['storm_s']} s (unloaded TTFT {result['ttft_s'] * 1e3:.0f} ms, ITL {result['itl_s'] * 1e3:.0f} ms)"
    )
    print(f"abort to end ms: {result['abort_ms']}, abort found=false: {result['abort_not_found']}")
    print(f"refused during storm (by how the thread's previous request ended): {result['refused_during'] or 0}")
    print(f"blocks held right after the storm: {result['held_at_end']}; after up to 30 s: {result['leaked_per_pool']}")
    print(f"all blocks free {result['zero_after_s']} s after the storm (None: not within 120 s)")
    print(f"admission check after ({args.concurrency} at once, reused ids): {result['check']}")
    print(f"ended: {result['ended']}")
    print(f"leaked blocks: {result['leaked_blocks']}")
    print(f"abort to end p50 ms: {result['abort_ms']['p50'] if abort_ms else None}")
    print(f"refused after: {refused_after}")


if __name__ == "__main__":
    sys.exit(main())
