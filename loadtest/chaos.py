"""Chaos: steady traffic while worker processes are killed, and what it cost.

Starts `disagg serve` (the default deployment, 1 prefill + 1 decode worker, its own Ray and
redis-server, gRPC on 127.0.0.1), computes each prompt's fault-free greedy output, then runs
`--concurrency` clients in a closed loop for `--minutes` while a random prefill or decode
worker process is SIGKILLed every `--kill-every` seconds, and redis-server once, halfway.
Every request's output is compared with the fault-free one. After the load stops: KV blocks
still allocated on every instance, RSS of each process after the warm-up and at the end,
recovery time per kill (kill -> the process back, every instance listed and a request served).

    PYTHONPATH=. .venv/bin/python loadtest/chaos.py --minutes 5 --kill-every 30

The last lines are `lost: N`, `wrong outputs: N`, `leaked blocks: N`, `recovery p50 s: X`,
`rss drift %: X` (the largest growth of a process's RSS from the warm-up's end to the end).
With `--kill-every 0` nothing is killed: a soak (`--minutes 30 --kill-every 0`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from disagg.client import DisaggClient, generate_request
from served import Deployment, add_config_argument, leaked_blocks, listed

PROMPTS = [
    "Write a story about a dragon.",
    "Describe the ocean in detail.",
    "Explain how rain forms.",
    "Tell me about ancient Rome.",
    "List some uses of copper.",
    "Why is the sky blue?",
    "Describe a busy market.",
    "How do bees make honey?",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills; 0: none (a soak)")
    p.add_argument(
        "--warm-up", type=float, help="seconds of load before the RSS baseline (default: 60 for a soak, else 0)"
    )
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loadtest/out/chaos.json")
    add_config_argument(p)
    args = p.parse_args(argv)
    if args.warm_up is None:
        args.warm_up = 60.0 if args.kill_every <= 0 else 0.0
    return args


def request(i: int, max_tokens: int):
    return generate_request(
        chat=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
    )  # fmt: skip


class Load:
    """Closed-loop clients; every outcome counted, every output checked."""

    def __init__(self, client: DisaggClient, reference: list[list[int]], args):
        self.client, self.reference, self.args = client, reference, args
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.sent, self.completed, self.wrong = 0, 0, 0
        self.failed: Counter[str] = Counter()
        self.messages: dict[str, int] = {}  # error details -> count

    def run(self, worker: int) -> None:
        i = worker
        while not self.stop.is_set():
            with self.lock:
                self.sent += 1
            try:
                tokens, _, _ = self.client.generate(request(i, self.args.max_tokens), timeout=300)
            except grpc.RpcError as exc:
                with self.lock:
                    self.failed[exc.code().name] += 1
                    self.messages.setdefault(exc.details()[:160], 0)
                    self.messages[exc.details()[:160]] += 1
            else:
                with self.lock:
                    self.completed += 1
                    self.wrong += tokens != self.reference[i % len(PROMPTS)]
            i += self.args.concurrency


def kill_on_schedule(args, dep: Deployment, client: DisaggClient, rng, expected: int, started: float, end: float):
    """A random worker every `--kill-every` seconds; redis-server instead at the first kill past halfway."""
    kills, redis_killed = [], False
    while time.monotonic() + args.kill_every <= end:
        time.sleep(args.kill_every)
        redis = not redis_killed and time.monotonic() - started >= (end - started) / 2
        redis_killed |= redis
        kills.append(kill_and_time_recovery(dep, client, rng, expected, redis=redis))
        last = kills[-1]
        print(f"killed {last['worker'][:40]} (pid {last['pid']}): recovered in {last['recovery_s']} s", flush=True)
    return kills


def kill_and_time_recovery(
    dep: Deployment, client: DisaggClient, rng: random.Random, expected: int, redis: bool = False
) -> dict:
    victims = dep.redis() if redis else dep.workers()
    pid, name = rng.choice(sorted(victims.items()))
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while not redis and listed(client) >= expected and time.monotonic() - killed_at < 10:
        time.sleep(0.1)  # the router notices (a broken link, or the heartbeat's lapse)
    while time.monotonic() - killed_at < 300:
        try:
            back = not redis or dep.redis()  # the router's view outlives Redis: wait for the process
            if back and listed(client) >= expected and client.generate(request(0, 2), timeout=30)[0]:
                break
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    return {"pid": pid, "worker": name, "recovery_s": round(time.monotonic() - killed_at, 2)}


def rss_drift_pct(start: dict[str, float], end: dict[str, float], min_mb: float = 50.0) -> float:
    """The largest RSS growth, in percent, of a process alive at both times (a relaunched worker
    is a new process) and big enough to matter."""
    common = [name for name in start if name in end and start[name] >= min_mb]
    return max((100.0 * (end[n] - start[n]) / start[n] for n in common), default=0.0)


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="disagg-chaos-") as tmp:
        dep = Deployment(Path(tmp), args.config)
        try:
            return run(args, dep, rng)
        finally:
            dep.stop()


def run(args, dep: Deployment, rng: random.Random) -> int:
    with DisaggClient(dep.address) as client:
        expected = listed(client)
        reference = [client.generate(request(i, args.max_tokens), timeout=300)[0] for i in range(len(PROMPTS))]
        load = Load(client, reference, args)
        threads = [threading.Thread(target=load.run, args=(w,), daemon=True) for w in range(args.concurrency)]
        for t in threads:
            t.start()
        started = time.monotonic()
        end = started + args.minutes * 60
        time.sleep(min(args.warm_up, args.minutes * 60))
        rss_start = dep.rss_mb()
        kills = kill_on_schedule(args, dep, client, rng, expected, started, end) if args.kill_every > 0 else []
        time.sleep(max(0.0, end - time.monotonic()))
        load.stop.set()
        for t in threads:
            t.join(timeout=320)
        leaked, rss_end, migrated = leaked_blocks(client), dep.rss_mb(), dep.migrations()
    recoveries = [k["recovery_s"] for k in kills]
    result = {
        "args": vars(args), "sent": load.sent, "completed": load.completed, "failed": dict(load.failed),
        "migrated": migrated, "wrong_outputs": load.wrong, "errors": load.messages, "leaked_blocks": leaked, "kills": kills,
        "rss_mb_start": rss_start, "rss_mb_end": rss_end,
        "recovery_p50_s": statistics.median(recoveries) if recoveries else None,
        "rss_drift_pct": rss_drift_pct(rss_start, rss_end),
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"sent {load.sent}, completed {load.completed}, failed {dict(load.failed) or 0}, migrated {migrated:.0f}")
    for name, mb in rss_start.items():
        print(f"RSS start {mb:7.0f} MB  {name}")
    for name, mb in rss_end.items():
        print(f"RSS end   {mb:7.0f} MB  {name}")
    print(f"wrote {args.out}")
    print(f"lost: {sum(load.failed.values())}")
    print(f"wrong outputs: {load.wrong}")
    print(f"leaked blocks: {leaked}")
    print(f"recovery p50 s: {result['recovery_p50_s']}")
    print(f"rss drift %: {result['rss_drift_pct']:.1f}")
    return 0 if not load.failed and not load.wrong and not leaked else 1


if __name__ == "__main__":
    sys.exit(main())
