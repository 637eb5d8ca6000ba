"""Scale, not only switch (issue 53, item 3): a load step up grows the limiting pool, a step down
shrinks it, and no request is lost.

A Ray cluster of `--nodes` nodes on this machine (Ray's own multi-node test cluster,
ray.cluster_utils.Cluster), each declaring `--node-cpus` CPUs: room for one instance of the default
model per node (every worker reserves as much, `num_cpus_per_worker`). `disagg serve` joins it
(`ray_address`) with one prefill and one decode instance, one thread each, re-planning on with
scaling on (switching as it is), and a TTFT target so that attainment can tell the splits apart.

The load, open loop (Poisson arrivals) from this process to the frontend on 127.0.0.1: a step up
of prefill-heavy requests (600-800 token prompts, 4-8 token outputs) for `--up-s` seconds, then a
trickle of short requests at `--down-rate` until the pool that grew has shrunk back (or `--down-s`
at most). The step is sized to this host as it is now (it is shared): the TTFT target is
TTFT_PREFILLS prefills of the mean prompt, timed on one thread before the cluster starts; the
step's rate is UP_LOAD prompts per prefill as the deployment serves one just before the step (three
timed one at a time): one prefill instance falls behind, two keep up (`--ttft-ms`, `--up-rate`:
given instead). Requests are never refused for the SLO (`slo_admission: best_effort`): each
completes, is refused by the in-flight limits (counted apart), or is lost.

Prints the pool sizes over time (from `disagg status`, the frontend's ClusterStatus, polled every
`--poll-s`), every scale step the controller took (when decided, when serving, why), the requests
sent / completed / lost, and last:

    scaling grew: <pool> at <t> s      (none: it did not grow)
    scaling shrank: <pool> at <t> s
    scaling lost: <n>

(t: seconds since the load started, when the step was done; the shrink: the first removal decided
in the trickle, every step printed above). Everything has a deadline (the cluster's start, the
deployment's, each request, the whole run: `--timeout-s`); the cluster is shut down on the way out.

    .venv/bin/python -m loadtest.planner.scaling [--nodes 3] [--up-s 90] [--up-rate R --ttft-ms T]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

from disagg.bench.launcher import Deployment, add_config_argument
from disagg.bench.load_client import GrpcApi, LoadRequest, closed_loop, new_record, run_loop
from disagg.bench.metrics import RequestRecord
from disagg.bench.results import host_line, write_results
from disagg.client import DisaggClient, generate_request

ENGINE = {"num_kv_blocks": 2048, "max_num_batched_tokens": 512}  # a queued prompt holds its decode KV: room for 40
VOCAB = (1000, 40000)  # prompt token ids are drawn from here
UP_LENGTHS = ((600, 800), (4, 8))  # prefill-heavy: (prompt, output) token ranges
DOWN_LENGTHS = ((16, 32), (8, 16))  # the trickle's
# The step up's rate, in prompts per prefill time of one as the deployment serves it just before:
# one prefill instance cannot keep up (its queue, and so TTFT, grows while it lasts), two can.
UP_LOAD = 1.6
TTFT_PREFILLS = 4.0  # the TTFT target, in prefill times measured before the cluster starts
STEP_KINDS = ("add", "remove")
# The server's overload answer (its in-flight limit): the request was refused, not lost. (The SLO
# refuses nothing here: slo_admission best_effort.)
REFUSED = "RESOURCE_EXHAUSTED"


# ---- the cluster and the deployment --------------------------------------------------------------
def start_cluster(nodes: int, node_cpus: float, timeout_s: float):
    """Ray's multi-node test cluster on this machine: `nodes` nodes of `node_cpus` CPUs each."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": node_cpus})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=node_cpus)
        cluster.wait_for_nodes(timeout=timeout_s)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def serving_settings(args, ray_address: str) -> dict:
    pool = {"num_instances": 1, "num_cpus_per_worker": args.node_cpus}
    replan = {"replan": True, "replan_scale": True, "replan_interval_s": args.interval_s,
              "replan_window_s": args.window_s, "replan_hold_s": args.hold_s,
              "replan_max_total_instances": args.nodes}  # fmt: skip
    return {"ray_address": ray_address, "mode": "disaggregated", "prefill": pool, "decode": pool,
            "engine": ENGINE, "threads_per_worker": 1, "calibration_s": args.calibration_s,
            "slo": {"ttft_ms": args.ttft_ms, "tpot_ms": 0}, "slo_admission": "best_effort",
            "http_port": 0, **replan}  # fmt: skip


# ---- what the deployment shows, polled ------------------------------------------------------------
@dataclass
class PoolWatch:
    """The pools' sizes (healthy instances) over time and the controller's scale steps, from
    the frontend's ClusterStatus every `poll_s`, on a thread of its own."""

    address: str
    poll_s: float
    sizes: list[tuple[float, int, int]] = field(default_factory=list)  # (time.time(), prefill, decode)
    steps: dict[tuple[float, str], dict] = field(default_factory=dict)  # (decided, instance) -> the step
    rounds: dict[float, tuple[str, str, str]] = field(default_factory=dict)  # decided -> (current, best, reason)
    errors: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> PoolWatch:
        self._thread = threading.Thread(target=self._run, name="pool-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        with DisaggClient(self.address) as client:
            while not self._stop.is_set():
                self.poll(client)
                self._stop.wait(self.poll_s)

    def poll(self, client: DisaggClient) -> None:
        try:
            status = client.cluster_status(timeout=5.0)
        except Exception:  # noqa: BLE001 - a slow answer under load: the next poll
            self.errors += 1
            return
        healthy = {p.role: sum(i.healthy for i in p.instances) for p in status.pools}
        self.sizes.append((time.time(), healthy.get("prefill", 0), healthy.get("decode", 0)))
        for d in status.replan_decisions:
            self.rounds[d.unix_time] = (d.current, d.best, d.reason)
            if d.step_kind in STEP_KINDS:
                self.steps[(d.unix_time, d.switched_instance)] = _step(d)

    def done_steps(self, kind: str) -> list[dict]:
        return sorted((s for s in self.steps.values() if s["kind"] == kind and s["outcome"] == "done"),
                      key=lambda s: s["decided"])  # fmt: skip

    def shrank_since(self, since: float) -> bool:
        """Whether a pool that grew has shrunk by a removal decided after `since` (time.time())."""
        return bool(self.done_steps("add")) and any(s["decided"] >= since for s in self.done_steps("remove"))


def _step(d) -> dict:
    role = _changed_pool(d.current, d.best)
    return {"kind": d.step_kind, "pool": role, "decided": d.unix_time, "seconds": d.switch_seconds,
            "outcome": d.switch_outcome, "from": d.current, "to": d.best, "instance": d.switched_instance,
            "reason": d.reason, "check": d.check_outcome}  # fmt: skip


def _changed_pool(current: str, best: str) -> str:
    """Which pool differs between two splits written "1P:2D"."""
    return "prefill" if current.split(":")[0] != best.split(":")[0] else "decode"


# ---- the step up, sized to this host now --------------------------------------------------------
def measured_prefill_s(prompt_tokens: int, repeats: int = 3) -> float:
    """Seconds one engine thread takes to prefill `prompt_tokens` on this host now: the default
    model, in this process, the fastest of `repeats` (before the cluster starts)."""
    import torch

    from disagg import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(dtype="auto")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng, times = random.Random(3), []
    for _ in range(repeats):  # prompts of their own: no prefix cached
        prompt = {"prompt_token_ids": [rng.randrange(*VOCAB) for _ in range(prompt_tokens)]}
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - started)
    return min(times)


def mean_prompt(args) -> int:
    (lo, hi), _ = UP_LENGTHS
    return max(1, round((lo + hi) / 2 * args.length_scale))


def size_the_target(args) -> None:
    """`--ttft-ms` where not given: from a prefill of the step's mean prompt timed in this process."""
    if args.ttft_ms:
        return
    prefill_s = measured_prefill_s(mean_prompt(args))
    args.ttft_ms = TTFT_PREFILLS * prefill_s * 1e3
    print(f"prefill of {mean_prompt(args)} tokens: {prefill_s * 1e3:.0f} ms on one thread; "
          f"TTFT target {args.ttft_ms:.0f} ms", flush=True)  # fmt: skip


def size_the_rate(address: str, args, probes: int = 3) -> None:
    """`--up-rate` where not given: from the TTFT of the step's mean prompt through the deployment
    just before it (one at a time: the prefill instance's time as it serves now, the host shared)."""
    if args.up_rate:
        return
    rng = random.Random(5)
    prompts = [[rng.randrange(*VOCAB) for _ in range(mean_prompt(args))] for _ in range(probes)]
    requests = [LoadRequest(generate_request(prompt_token_ids=p, max_tokens=1, temperature=0.0, ignore_eos=True),
                            len(p)) for p in prompts]  # fmt: skip
    run = run_loop(GrpcApi(address, timeout_s=args.request_timeout_s), closed_loop, requests, 1)
    ttfts = [r.ttft for r in run.records if r.success]
    if not ttfts:
        raise RuntimeError(f"no probe answered: {[r.error for r in run.records]}")
    args.up_rate = UP_LOAD / statistics.median(ttfts)
    print(f"served prefill of {mean_prompt(args)} tokens: {statistics.median(ttfts) * 1e3:.0f} ms; "
          f"step up at {args.up_rate:.2f} req/s", flush=True)  # fmt: skip


# ---- the load ---------------------------------------------------------------------------------------
def request(rng: random.Random, lengths: tuple[tuple[int, int], tuple[int, int]], scale: float = 1.0) -> LoadRequest:
    (p_lo, p_hi), (o_lo, o_hi) = ((max(1, round(lo * scale)), max(1, round(hi * scale))) for lo, hi in lengths)
    prompt = [rng.randrange(*VOCAB) for _ in range(rng.randint(p_lo, p_hi))]
    message = generate_request(prompt_token_ids=prompt, max_tokens=rng.randint(o_lo, o_hi), temperature=0.0,
                               ignore_eos=True)  # fmt: skip
    return LoadRequest(message, len(prompt))


@dataclass
class LoadPlan:
    up_rate: float
    up_s: float
    down_rate: float
    down_s: float
    request_timeout_s: float
    length_scale: float = 1.0
    seed: int = 1


async def send_load(address: str, plan: LoadPlan, done: threading.Event | None = None) -> tuple[list, float]:
    """The step up, then the trickle until `done` is set (or down_s). Returns every request's
    record with its phase, and when the load started (time.time())."""
    rng, zero, wall = random.Random(plan.seed), time.perf_counter(), time.time()
    sent: list[tuple[str, asyncio.Task]] = []
    async with GrpcApi(address, timeout_s=plan.request_timeout_s) as api:
        due = 0.0
        for phase, rate, until, lengths in (("up", plan.up_rate, plan.up_s, UP_LENGTHS),
                                            ("down", plan.down_rate, plan.up_s + plan.down_s, DOWN_LENGTHS)):  # fmt: skip
            while due < until and not (phase == "down" and done is not None and done.is_set()):
                await asyncio.sleep(max(0.0, zero + due - time.perf_counter()))
                load = request(rng, lengths, plan.length_scale)
                record = new_record(len(sent), load)
                sent.append((phase, asyncio.create_task(api.send(load, record, zero, lane=len(sent)))))
                due += rng.expovariate(rate)
            due = max(due, until)
        records = await asyncio.wait_for(asyncio.gather(*(t for _, t in sent)), plan.request_timeout_s + 30)
    return [(phase, r) for (phase, _), r in zip(sent, records)], wall


def completed(record: RequestRecord) -> bool:
    return record.success and record.output_len == record.target_output_len


# ---- figures ----------------------------------------------------------------------------------------
def size_changes(sizes: list[tuple[float, int, int]], start: float) -> list[tuple[float, str]]:
    """(seconds since `start`, "1P:2D") at the first poll and at every change."""
    out: list[tuple[float, str]] = []
    for at, prefill, decode in sizes:
        split = f"{prefill}P:{decode}D"
        if not out or out[-1][1] != split:
            out.append((at - start, split))
    return out


def first_done(steps: list[dict], start: float, after: float = -1e18) -> tuple[str, float] | None:
    """(pool, seconds since `start` when it was done) of the first step decided after `after`."""
    for s in steps:
        if s["decided"] > after:
            return s["pool"], s["decided"] + s["seconds"] - start
    return None


def report(watch: PoolWatch, sent: list, start: float, args) -> dict:
    grown, shrunk = watch.done_steps("add"), watch.done_steps("remove")
    grew = first_done(grown, start)
    shrank = first_done(shrunk, start, start + args.up_s) if grown else None  # by the step down
    refused = [r for _, r in sent if r.error_code == REFUSED]
    lost = [r for _, r in sent if not completed(r) and r.error_code != REFUSED]
    by_phase = {p: sum(1 for q, _ in sent if q == p) for p in ("up", "down")}
    figures = {
        "pool sizes": [[round(t, 1), split] for t, split in size_changes(watch.sizes, start)],
        "scale steps": [{**s, "decided": round(s["decided"] - start, 1), "seconds": round(s["seconds"], 1)}
                        for s in sorted(watch.steps.values(), key=lambda s: s["decided"])],  # fmt: skip
        "requests sent": len(sent), "sent in the step up": by_phase["up"], "sent in the trickle": by_phase["down"],
        "requests completed": sum(completed(r) for _, r in sent), "requests refused": len(refused),
        "requests lost": len(lost), "lost errors": sorted({f"{r.error_code}: {r.error[:80]}" for r in lost + refused}),
        "status polls failed": watch.errors,
        "trickle started at s": args.up_s,
        "grew": grew, "shrank": shrank,
        "rounds": [[round(t - start, 1), *seen] for t, seen in sorted(watch.rounds.items())],
        "requests": [_row(phase, r) for phase, r in sent],
    }  # fmt: skip
    return figures


def _row(phase: str, r: RequestRecord) -> dict:
    return {"phase": phase, "sent_at": round(r.sent_at, 2), "ok": completed(r), "error": r.error_code,
            "ttft_ms": round(r.ttft * 1e3, 1), "tpot_ms": round(r.tpot * 1e3, 1), "output_len": r.output_len}  # fmt: skip


def print_report(figures: dict) -> None:
    print(f"step up: 0 s to {figures['trickle started at s']:g} s; trickle from then on")
    for t, split in figures["pool sizes"]:
        print(f"pools at {t:7.1f} s: {split}")
    for s in figures["scale steps"]:
        print(f"scale step: {s['kind']} {s['pool']} decided at {s['decided']} s, {s['outcome']} after {s['seconds']} s "
              f"({s['from']} -> {s['to']}; check {s['check'] or '-'}): {s['reason']}")  # fmt: skip
    for name in (
        "requests sent",
        "sent in the step up",
        "sent in the trickle",
        "requests completed",
        "requests refused",
        "requests lost",
    ):
        print(f"{name}: {figures[name]}")
    for error in figures["lost errors"]:
        print(f"failed: {error}")
    print(f"scaling grew: {_when(figures['grew'])}")
    print(f"scaling shrank: {_when(figures['shrank'])}")  # by a removal decided in the trickle
    print(f"scaling lost: {figures['requests lost']}", flush=True)


def _when(step: tuple[str, float] | None) -> str:
    return f"{step[0]} at {step[1]:.1f} s" if step else "none"


# ---- the run ------------------------------------------------------------------------------------------
def run(args) -> dict:
    started = time.monotonic()
    cluster = start_cluster(args.nodes, args.node_cpus, args.cluster_timeout_s)
    print(f"cluster: {args.nodes} nodes of {args.node_cpus:g} CPUs ({time.monotonic() - started:.0f} s)", flush=True)
    try:
        settings = serving_settings(args, cluster.address)
        with Deployment(settings, base=args.config, workdir=args.workdir, name="scaling",
                        start_timeout_s=args.start_timeout_s) as dep:  # fmt: skip
            print(f"serving on {dep.address} ({time.monotonic() - started:.0f} s)", flush=True)
            return _load_and_watch(dep.address, args)
    finally:
        cluster.shutdown()


def _load_and_watch(address: str, args) -> dict:
    size_the_rate(address, args)
    watch = PoolWatch(address, args.poll_s).start()
    done = threading.Event()
    trickle_from = time.time() + args.up_s
    stopper = threading.Thread(target=_until_shrunk, args=(watch, done, trickle_from, args.after_shrink_s), daemon=True)
    stopper.start()
    plan = LoadPlan(args.up_rate, args.up_s, args.down_rate, args.down_s, args.request_timeout_s, args.length_scale)
    try:
        sent, start = asyncio.run(send_load(address, plan, done))
        time.sleep(args.poll_s)  # one more poll: the last step's outcome
    finally:
        done.set()
        watch.stop()
    return report(watch, sent, start, args)


def _until_shrunk(watch: PoolWatch, done: threading.Event, trickle_from: float, after_s: float) -> None:
    """Sets `done` `after_s` once the pool that grew has shrunk in the trickle (which ends then)."""
    while not done.wait(0.5):
        if watch.shrank_since(trickle_from):
            done.wait(after_s)
            done.set()


def _deadline(seconds: float) -> None:
    """The whole run's: SIGALRM raises in the main thread, so that every `finally` (the
    deployment's stop, the cluster's shutdown) still runs."""

    def expired(*_):
        raise TimeoutError(f"the benchmark ran past --timeout-s {seconds:.0f}")

    signal.signal(signal.SIGALRM, expired)
    signal.alarm(max(1, int(seconds)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=3, help="Ray nodes on this machine (one instance fits each)")
    p.add_argument("--node-cpus", type=float, default=1.0, help="CPUs each node declares, and each worker reserves")
    p.add_argument("--up-rate", type=float, help=f"req/s of the step up (default: {UP_LOAD} / a measured prefill)")
    p.add_argument("--up-s", type=float, default=90.0, help="seconds of the step up")
    p.add_argument("--down-rate", type=float, default=1.0, help="req/s of the trickle after it")
    p.add_argument("--down-s", type=float, default=180.0, help="the trickle's seconds at most (it ends once shrunk)")
    p.add_argument("--after-shrink-s", type=float, default=5.0, help="the trickle goes on this long after the shrink")
    p.add_argument("--length-scale", type=float, default=1.0, help="scales every prompt's and output's length")
    p.add_argument("--ttft-ms", type=float, help=f"the SLO's (default: {TTFT_PREFILLS:g} measured prefills)")
    p.add_argument("--interval-s", type=float, default=3.0, help="replan_interval_s")
    p.add_argument("--window-s", type=float, default=15.0, help="replan_window_s")
    p.add_argument("--hold-s", type=float, default=20.0, help="replan_hold_s")
    p.add_argument("--calibration-s", type=float, default=10.0, help="the server's start-up calibration (0: none)")
    p.add_argument("--poll-s", type=float, default=1.0, help="how often the pools' sizes are read")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--cluster-timeout-s", type=float, default=120.0)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--timeout-s", type=float, default=900.0, help="the whole run's limit")
    p.add_argument("--json", help="write every figure here too (each request's, each round's reason)")
    p.add_argument("--workdir", help="keep the server's config and log here (default: a temporary directory)")
    add_config_argument(p)
    args = p.parse_args(argv)
    if args.nodes < 2 or args.node_cpus <= 0:
        p.error("--nodes must be >= 2 and --node-cpus > 0")
    print(host_line(), flush=True)
    _deadline(args.timeout_s)
    try:
        size_the_target(args)
        figures = run(args)
    finally:
        signal.alarm(0)
    print_report(figures)
    if args.json:
        write_results(args.json, figures, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
