"""Live migration under load, through the real service (issue 36): how long a request's stream
stalls when it moves to another decode instance with its KV, against a decode step.

A server of the default model (1 prefill + 2 decode instances, Ray, redis-server, gRPC on
127.0.0.1). Every request first runs on decode instance A (B is kept out of placement); once
each has streamed --move-after tokens, B comes back and A drains: every request moves to B.
The same requests ran before with nothing moved. Prints, one per line: the requests moved, the
tokens recomputed (requests that migrated by recompute instead), lost and wrong outputs, the
gap at the move (the client's largest gap between two tokens from the drain on, p50 and max),
the pause (that gap less one decode step: the time the request made no progress; Llumnix's
downtime) and the decode step (the client's median gap between tokens outside the move). It
runs twice: the first move between two instances maps the peer's cache, the second finds it
mapped.

    .venv/bin/python -m loadtest.kv.live_migration [--requests 6] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray

from disagg.bench.launcher import Deployment, add_config_argument
from disagg.bench.results import host_line
from disagg.client import DisaggClient, generate_request

QUESTIONS = [
    "Write a story about a dragon.",
    "Describe the ocean.",
    "Explain how rain forms.",
    "Tell me about Rome.",
    "Why is the sky blue?",
    "Describe a busy market.",
    "Write a poem about autumn.",
    "Explain what a compiler does.",
]


def listed(client) -> set[str]:
    return {i.instance_id for pool in client.cluster_status().pools for i in pool.instances}


def wait_listed(client, instance_id: str, present: bool, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while (instance_id in listed(client)) != present:
        if time.monotonic() > deadline:
            raise SystemExit(f"{instance_id} {'never came back' if present else 'is still listed'}")
        time.sleep(0.1)


def stream_all(client, requests, on_all_started=None, after_tokens: int = 0):
    """[(tokens, arrival times, error)] of every request, streamed at once; `on_all_started` runs
    once each has `after_tokens` tokens."""
    barrier = threading.Barrier(len(requests) + 1, timeout=300)

    def one(request):
        tokens, times, error, told = [], [], None, False
        try:
            for msg in client.stream(request, timeout=600):
                now = time.monotonic()
                tokens += msg.token_ids
                times += [now] * len(msg.token_ids)
                if not told and len(tokens) >= after_tokens:
                    told = True
                    barrier.wait()
        except Exception as exc:  # noqa: BLE001 - counted as lost
            error = str(exc)
        if not told:
            barrier.wait()
        return tokens, times, error

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(one, r) for r in requests]
        barrier.wait()
        moved_at = on_all_started() if on_all_started is not None else None
        return [f.result() for f in futures], moved_at


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--move-after", type=int, default=24, help="tokens each request streams before the drain")
    add_config_argument(p)
    args = p.parse_args(argv)
    if not 2 <= args.move_after < args.max_tokens:
        p.error("need 2 <= --move-after < --max-tokens (a decode step before the drain, and tokens left to move)")
    settings = {
        "engine": {"num_kv_blocks": 600, "max_num_batched_tokens": 256},
        "prefill": {"num_instances": 1, "num_cpus_per_worker": 0.5},
        "decode": {"num_instances": 2, "num_cpus_per_worker": 0.5},
        "heartbeat_interval_s": 0.3,
        "heartbeat_ttl_s": 1.0,
        "calibration_s": 0,
        "replan": False,  # the drain is what is measured, not switches
    }
    print(host_line(), flush=True)
    questions = (QUESTIONS * 4)[: args.requests]
    requests = [
        generate_request(
            chat=[{"role": "user", "content": q}], ignore_eos=True, temperature=0.0, max_tokens=args.max_tokens
        )
        for q in questions
    ]
    # In this process: the drain is driven through the server's own actors.
    with Deployment(settings, base=args.config, in_process=True) as dep, DisaggClient(dep.address) as client:
        server = dep.server
        a, b = sorted((i for i in server.launcher.instances if i.role == "decode"), key=lambda i: i.instance_id)
        expected, _ = stream_all(client, requests)
        recomputed_before = dep.metric("disagg:request_migrations_total{")
        runs = []
        for label in ("first move between the two", "second move (peer caches mapped)"):
            ray.get(b.actor.set_heartbeat_enabled.remote(False))  # every request starts on A
            wait_listed(client, b.instance_id, present=False)

            def drain_a() -> float:
                ray.get(b.actor.set_heartbeat_enabled.remote(True))
                wait_listed(client, b.instance_id, present=True)
                started = time.monotonic()
                ray.get(a.actor.drain.remote(False))
                return started

            moved_before = server.live_moves.stats.moved
            got, drained_at = stream_all(client, requests, drain_a, after_tokens=args.move_after)
            runs.append((label, got, drained_at, server.live_moves.stats.moved - moved_before))
            ray.get(a.actor.resume_service.remote())
            wait_listed(client, a.instance_id, present=True)
        recomputed = dep.metric("disagg:request_migrations_total{") - recomputed_before
    failed = False
    for label, got, drained_at, moved in runs:
        failed |= report(label, requests, expected, got, drained_at, moved, recomputed)
    return 1 if failed else 0


def report(label, requests, expected, got, drained_at, moved, recomputed) -> bool:
    """Prints one run's figures; True when it lost, changed or recomputed anything."""
    lost = sum(1 for _, _, error in got if error)
    wrong = sum(1 for (tokens, _, error), (want, _, _) in zip(got, expected) if not error and tokens != want)
    stalls, steps = [], []
    for tokens, times, error in got:
        gaps = [(t1 - t0, t1) for t0, t1 in zip(times, times[1:]) if t1 > t0]
        after = [g for g, t1 in gaps if t1 >= drained_at]
        if after:
            stalls.append(max(after))
        steps += [g for g, t1 in gaps if t1 < drained_at]
    print(f"-- {label}")
    print(f"requests: {len(requests)}; moved with their KV: {moved}")
    print(f"recomputed migrations: {int(recomputed)}")
    print(f"lost: {lost}")
    print(f"wrong outputs: {wrong}")
    if not stalls or not steps:
        print("no request was still streaming when the drain began: raise --max-tokens above --move-after")
        return True
    step = statistics.median(steps)
    print(f"stream gap at the move p50 ms: {statistics.median(stalls) * 1e3:.1f} (max {max(stalls) * 1e3:.1f})")
    print(f"migration pause p50 ms: {(statistics.median(stalls) - step) * 1e3:.1f} (the gap less one decode step)")
    print(f"decode step p50 ms: {step * 1e3:.1f}")
    return bool(lost or wrong or recomputed) or moved != len(requests)


if __name__ == "__main__":
    sys.exit(main())
