"""Chaos: steady traffic while worker processes are killed, and what it cost.

Starts `disagg serve` (the default deployment, 1 prefill + 1 decode worker, its own Ray and
redis-server, gRPC on 127.0.0.1), computes each prompt's fault-free greedy output, then runs
`--concurrency` clients in a closed loop for `--minutes` while a random prefill or decode
worker process is SIGKILLed every `--kill-every` seconds, and redis-server once, halfway.
Every request's output is compared with the fault-free one (the engines run `batch_invariant`, so
that an output does not depend on how many requests decode beside it). After the load stops: KV blocks
still allocated on every instance, RSS of each process after the warm-up and at the end,
recovery time per kill (kill -> the process back, every instance listed and a request served).

    .venv/bin/python -m loadtest.faults.chaos --minutes 5 --kill-every 30

The last lines are `lost: N`, `wrong outputs: N`, `leaked blocks: N`, `recovery p50 s: X`,
`rss drift %: X` (the largest growth of a process's RSS from the warm-up's end to the end).
With `--kill-every 0` nothing is killed: a soak (`--minutes 30 --kill-every 0`).

With `--frontends N` the deployment runs N frontends and client i sends through frontend i mod N;
a request that fails is sent once more through the next frontend, and counts as lost only if that
fails too. `--kill-frontend-every S` SIGKILLs a random frontend (each a detached actor that Ray
restarts: `disagg serve` runs none itself) every S seconds, beside the worker kills.

    .venv/bin/python -m loadtest.faults.chaos --minutes 5 --kill-every 30 --frontends 2 --kill-frontend-every 60

`--kill-controller-every S` SIGKILLs the deployment's controller (disagg.controller: relaunch
supervision and re-planning) every S seconds; its recovery: until Ray has started it again, it
has adopted the workers (every instance listed) and frontend 0's health says SERVING (a lapsed
controller heartbeat turns it NOT_SERVING).

    .venv/bin/python -m loadtest.faults.chaos --minutes 5 --kill-every 30 --frontends 2 --kill-controller-every 60

`--kill-serve-every S` SIGKILLs the `disagg serve` process itself every S seconds and runs
`disagg serve` again, as an operator would, which attaches to the deployment; its recovery: until
that one has attached, every frontend's health says SERVING (it lapses if the controller, which
runs re-planning and relaunch supervision, is gone) and the controller's process runs, with every
instance listed. redis-server is not killed in such a run: its supervisor lives in the first
`disagg serve` (issue 52's item 2).

    .venv/bin/python -m loadtest.faults.chaos --minutes 3 --frontends 2 --kill-serve-every 60 --kill-controller-every 60
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections import Counter

import grpc

from disagg.bench.launcher import Deployment, add_config_argument, leaked_blocks, listed
from disagg.bench.load_client import GrpcApi, LoadRequest, LoadRun, closed_loop, run_loop
from disagg.bench.results import host_line, write_results
from disagg.client import DisaggClient, generate_request

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
    p.add_argument("--frontends", type=int, default=1, help="frontends of the deployment (ServingConfig.frontends)")
    p.add_argument("--kill-frontend-every", type=float, default=0.0, help="seconds between frontend kills; 0: none")
    p.add_argument("--kill-controller-every", type=float, default=0.0, help="seconds between controller kills; 0: none")
    p.add_argument("--kill-serve-every", type=float, default=0.0,
                   help="seconds between SIGKILLs of `disagg serve` (run again: it attaches); 0: none")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="loadtest/out/chaos.json")
    add_config_argument(p)
    args = p.parse_args(argv)
    if args.warm_up is None:
        args.warm_up = 60.0 if args.kill_every <= 0 else 0.0
    if args.kill_frontend_every > 0 and args.frontends < 2:
        p.error("--kill-frontend-every needs --frontends 2 or more (a client retries on another)")
    return args


def request(i: int, max_tokens: int):
    return generate_request(
        chat=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
    )  # fmt: skip


class Load:
    """The closed loop (disagg.bench.load_client) in a thread of its own until stopped: with
    several frontends client w sends through frontend w mod N, and a failed request once more
    through the next. Every output is checked against the fault-free one once it is stopped."""

    def __init__(self, addresses: list[str], args):
        self.stop = threading.Event()
        self.started, self.zero = time.monotonic(), time.perf_counter()  # the same moment on both clocks
        self.run: LoadRun | None = None
        requests = [LoadRequest(request(i, args.max_tokens)) for i in range(len(PROMPTS))]
        api = GrpcApi(addresses, timeout_s=300, failover=True)
        loop = lambda: run_loop(api, closed_loop, requests, args.concurrency, self.stop.is_set, self.zero)  # noqa: E731
        self.thread = threading.Thread(target=lambda: setattr(self, "run", loop()), daemon=True)

    def outcome(self, reference: list[list[int]]) -> dict:
        """Sent, completed, failed (by code), retried, wrong (and when and where), error details."""
        records = self.run.records if self.run else []
        failed, messages, wrong = Counter(), Counter(), []
        for r in records:
            if not r.success:
                failed[r.error_code] += 1
                messages[r.error[:160]] += 1
            elif r.token_ids != reference[r.index % len(PROMPTS)]:
                expected = reference[r.index % len(PROMPTS)]
                first = next((k for k, (x, y) in enumerate(zip(r.token_ids, expected)) if x != y), None)
                wrong.append({"at_s": round(r.sent_at + r.e2el, 1), "frontend": r.server.get("frontend"),
                              "prompt": r.index % len(PROMPTS), "first_wrong_token": first,
                              "length": len(r.token_ids)})  # fmt: skip
        return {
            "sent": len(records), "completed": sum(r.success for r in records), "failed": dict(failed),
            "retried": sum(r.retried for r in records), "wrong": wrong, "messages": dict(messages),
        }  # fmt: skip


def kill_on_schedule(args, dep: Deployment, client: DisaggClient, rng, expected: int, started: float, end: float):
    """A random worker every `--kill-every` seconds; redis-server instead at the first kill past
    halfway (unless `disagg serve`, its supervisor, is killed too)."""
    kills, redis_killed = [], args.kill_serve_every > 0
    while time.monotonic() + args.kill_every <= end:
        time.sleep(args.kill_every)
        redis = not redis_killed and time.monotonic() - started >= (end - started) / 2
        redis_killed |= redis
        kills.append(kill_and_time_recovery(dep, client, rng, expected, redis=redis))
        last = kills[-1]
        print(f"killed {last['worker'][:40]} (pid {last['pid']}): recovered in {last['recovery_s']} s", flush=True)
    return kills


def kill_frontends_on_schedule(args, dep: Deployment, rng, end: float) -> list[dict]:
    """A random frontend replica every `--kill-frontend-every` seconds; recovery: until every
    frontend serves a request again (Ray restarts the replica on its port)."""
    kills = []
    while time.monotonic() + args.kill_frontend_every <= end:
        time.sleep(args.kill_frontend_every)
        victims = dep.frontend_replicas()
        if not victims:
            continue
        pid, name = rng.choice(sorted(victims.items()))
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while time.monotonic() - killed_at < 300 and not all_frontends_serve(dep):
            time.sleep(0.2)
        kills.append(
            {"pid": pid, "worker": name, "killed_at": killed_at, "recovery_s": round(time.monotonic() - killed_at, 2)}
        )
        print(f"killed frontend {name[:40]} (pid {pid}): recovered in {kills[-1]['recovery_s']} s", flush=True)
    return kills


def kill_controller_on_schedule(args, dep: Deployment, client: DisaggClient, expected: int, end: float) -> list[dict]:
    """The controller every `--kill-controller-every` seconds; recovery: a new controller process,
    every instance listed, and frontend 0 SERVING again."""
    kills = []
    while time.monotonic() + args.kill_controller_every <= end:
        time.sleep(args.kill_controller_every)
        victims = dep.controller()
        if not victims:
            continue
        (pid, name), *_ = sorted(victims.items())
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while time.monotonic() - killed_at < 300 and not controller_back(dep, client, pid, expected):
            time.sleep(0.2)
        kills.append(
            {"pid": pid, "worker": name, "killed_at": killed_at, "recovery_s": round(time.monotonic() - killed_at, 2)}
        )
        print(f"killed the controller (pid {pid}): back in {kills[-1]['recovery_s']} s", flush=True)
    return kills


def kill_serve_on_schedule(args, dep: Deployment, client: DisaggClient, expected: int, end: float) -> list[dict]:
    """`disagg serve` every `--kill-serve-every` seconds, then run again (it attaches); recovery:
    attached, the controller running, every instance listed and every frontend SERVING."""
    kills = []
    while time.monotonic() + args.kill_serve_every <= end:
        time.sleep(args.kill_serve_every)
        killed_at = time.monotonic()
        pid = dep.kill_serve()
        dep.attach()
        attached_s = time.monotonic() - killed_at
        while time.monotonic() - killed_at < 300 and not deployment_back(dep, client, expected):
            time.sleep(0.2)
        kills.append({"pid": pid, "worker": "disagg serve", "killed_at": killed_at,
                      "attached_s": round(attached_s, 2), "recovery_s": round(time.monotonic() - killed_at, 2)})  # fmt: skip
        print(f"killed disagg serve (pid {pid}): attached again in {kills[-1]['attached_s']} s; "
              f"health, re-planning and relaunch supervision back in {kills[-1]['recovery_s']} s", flush=True)  # fmt: skip
    return kills


def deployment_back(dep: Deployment, client: DisaggClient, expected: int) -> bool:
    """The controller runs, every instance is listed and every frontend is SERVING."""
    try:
        return bool(dep.controller()) and listed(client) >= expected and all(map(serving, dep.frontend_addresses))
    except grpc.RpcError:
        return False


def controller_back(dep: Deployment, client: DisaggClient, killed_pid: int, expected: int) -> bool:
    if not [pid for pid in dep.controller() if pid != killed_pid]:
        return False
    try:
        return listed(client) >= expected and serving(dep.address)
    except grpc.RpcError:
        return False


def serving(address: str) -> bool:
    """gRPC health of the frontend at `address` is SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def all_frontends_serve(dep: Deployment) -> bool:
    try:
        for address in dep.frontend_addresses:
            with DisaggClient(address) as client:
                if not client.generate(request(0, 2), timeout=30)[0]:
                    return False
        return True
    except grpc.RpcError:
        return False


def kill_and_time_recovery(
    dep: Deployment, client: DisaggClient, rng: random.Random, expected: int, redis: bool = False
) -> dict:
    victims = dep.redis() if redis else dep.workers()
    if not victims:  # say what runs instead of choosing from nothing
        raise RuntimeError(f"no {'redis-server' if redis else 'worker'} process of the deployment: {dep.processes()}")
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
    return {"pid": pid, "worker": name, "killed_at": killed_at, "recovery_s": round(time.monotonic() - killed_at, 2)}


def rss_drift_pct(start: dict[str, float], end: dict[str, float], min_mb: float = 50.0) -> float:
    """The largest RSS growth, in percent, of a process alive at both times (a relaunched worker
    is a new process) and big enough to matter."""
    common = [name for name in start if name in end and start[name] >= min_mb]
    return max((100.0 * (end[n] - start[n]) / start[n] for n in common), default=0.0)


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    print(host_line(), flush=True)
    # Every output is compared with the fault-free one: it must not depend on how many requests
    # decode beside it (the recovery probes add to the clients' load).
    settings = {"engine": {"batch_invariant": True}, "frontends": args.frontends}
    with Deployment(settings, base=args.config, name="chaos") as dep:
        return run(args, dep, rng)


def run(args, dep: Deployment, rng: random.Random) -> int:
    with DisaggClient(dep.address) as client:
        expected = listed(client)
        reference = [client.generate(request(i, args.max_tokens), timeout=300)[0] for i in range(len(PROMPTS))]
        load = Load(dep.frontend_addresses, args)
        load.thread.start()
        started = time.monotonic()
        end = started + args.minutes * 60
        time.sleep(min(args.warm_up, args.minutes * 60))
        rss_start = dep.rss_mb()
        frontend_kills: list[dict] = []
        controller_kills: list[dict] = []
        killer, controller_killer, serve_killer = None, None, None
        serve_kills: list[dict] = []
        if args.kill_serve_every > 0:
            serve_killer = threading.Thread(
                target=lambda: serve_kills.extend(kill_serve_on_schedule(args, dep, client, expected, end)), daemon=True
            )
            serve_killer.start()
        if args.kill_controller_every > 0:
            controller_killer = threading.Thread(
                target=lambda: controller_kills.extend(kill_controller_on_schedule(args, dep, client, expected, end)),
                daemon=True,
            )
            controller_killer.start()
        if args.kill_frontend_every > 0:
            killer = threading.Thread(
                target=lambda: frontend_kills.extend(
                    kill_frontends_on_schedule(args, dep, random.Random(args.seed + 1), end)
                ),
                daemon=True,
            )
            killer.start()
        kills = kill_on_schedule(args, dep, client, rng, expected, started, end) if args.kill_every > 0 else []
        time.sleep(max(0.0, end - time.monotonic()))
        for thread in (killer, controller_killer, serve_killer):
            if thread is not None:
                thread.join(timeout=320)
        load.stop.set()
        load.thread.join(timeout=320)
        leaked, rss_end, migrated = leaked_blocks(client), dep.rss_mb(), dep.metric("disagg:request_migrations_total{")
    outcome = load.outcome(reference)
    # seconds into the load, as the wrong outputs' times
    for kill in kills + frontend_kills + controller_kills + serve_kills:
        kill["at_s"] = round(kill.pop("killed_at") - load.started, 1)
    recoveries = [k["recovery_s"] for k in kills + frontend_kills]
    controller_recoveries = [k["recovery_s"] for k in controller_kills]
    frontend_recoveries = [k["recovery_s"] for k in frontend_kills]
    failed, wrong = outcome["failed"], outcome["wrong"]
    result = {
        "args": vars(args), "sent": outcome["sent"], "completed": outcome["completed"], "failed": failed,
        "migrated": migrated, "wrong_outputs": len(wrong), "errors": outcome["messages"], "leaked_blocks": leaked,
        "kills": kills, "frontend_kills": frontend_kills, "wrong": wrong, "retried_on_another_frontend": outcome["retried"],
        "frontend_recovery_p50_s": statistics.median(frontend_recoveries) if frontend_recoveries else None,
        "controller_kills": controller_kills,
        "controller_recovery_max_s": max(controller_recoveries) if controller_recoveries else None,
        "serve_kills": serve_kills,
        "serve_recovery_max_s": max((k["recovery_s"] for k in serve_kills), default=None),
        "rss_mb_start": rss_start, "rss_mb_end": rss_end,
        "recovery_p50_s": statistics.median(recoveries) if recoveries else None,
        "rss_drift_pct": rss_drift_pct(rss_start, rss_end),
    }  # fmt: skip
    write_results(args.out, result)
    print(f"sent {outcome['sent']}, completed {outcome['completed']}, failed {failed or 0}, migrated {migrated:.0f}")
    if args.frontends > 1:
        retried = outcome["retried"]
        print(f"frontends {args.frontends}: {len(frontend_kills)} killed, {retried} requests retried on another")
    for name, mb in rss_start.items():
        print(f"RSS start {mb:7.0f} MB  {name}")
    for name, mb in rss_end.items():
        print(f"RSS end   {mb:7.0f} MB  {name}")
    print(f"lost: {sum(failed.values())}")
    print(f"wrong outputs: {len(wrong)}")
    print(f"leaked blocks: {leaked}")
    print(f"recovery p50 s: {result['recovery_p50_s']}")
    if frontend_kills:
        print(f"frontend recovery p50 s: {result['frontend_recovery_p50_s']}")
    if controller_kills:
        print(f"controller kills: {len(controller_kills)}, back within s: {result['controller_recovery_max_s']}")
    if serve_kills:
        print(f"disagg serve kills: {len(serve_kills)}, back within s: {result['serve_recovery_max_s']}")
    print(f"rss drift %: {result['rss_drift_pct']:.1f}")
    return 0 if not failed and not wrong and not leaked else 1


if __name__ == "__main__":
    sys.exit(main())
