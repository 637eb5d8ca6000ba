"""The closed loop against every static split, through the real service (issue 36).

Three instances of the default model, one thread each, on this machine (`disagg serve` in its own
process: Ray, redis-server, gRPC on 127.0.0.1). The workload shifts: a prefill-heavy phase (long
prompts, short outputs), a decode-heavy phase (short prompts, long outputs), the prefill-heavy
phase again, each `--phase-s` seconds of Poisson arrivals at `--load` (0.8) of the best static
split's capacity for that phase: measured (`--prefill-capacity`, `--decode-capacity`, req/s), or
else the simulator's on the measured profile (deploy/profiles/smollm2-135m-cpu-1t.json; each
split's highest rate at 90% attainment), which is optimistic on this host (RESULTS.md).

The same requests (random prompt token ids, greedy) run on 2P:1D and 1P:2D with re-planning off,
on 2P:1D with re-planning on (it must move an instance at each phase change), and on a
colocated deployment of three instances with no time pressure (the reference outputs). Prints,
one per line: each static split's goodput, the best, the re-planning run's and their ratio; the
phase attainment gap (the largest shortfall, in points, of re-planning against the best static
split of each phase, counted from the moment its switch was done, or the phase's start where no
switch was due); settle s (phase change to switch done); switch p50 s (drain start to serving
in the new role); the migration pause (a moved request's longest gap between tokens during the
drain, less its median gap) against the decode step (the median gap between tokens); recomputed
tokens, lost and wrong outputs; flips; and the simulator's prediction of the same comparison.

    PYTHONPATH=. .venv/bin/python loadtest/bench_replan.py [--phase-s 60] [--load 0.8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from disagg.client import DisaggClient, generate_request
from disagg.config import ServingConfig
from disagg.placement.profile import load_profile
from disagg.planner.deployment import Deployment as PlannedDeployment
from disagg.planner.deployment import with_split
from disagg.planner.replan_sim import replan_report
from disagg.planner.simulator import slo_attainment
from disagg.planner.workload import SimRequest
from disagg.v1 import serving_pb2_grpc
from loadtest.served import Deployment, add_config_argument

PROFILE = "deploy/profiles/smollm2-135m-cpu-1t.json"
PHASES = {"prefill-heavy": ((700, 900), (4, 8)), "decode-heavy": ((20, 40), (150, 200))}
ORDER = ("prefill-heavy", "decode-heavy", "prefill-heavy")
SLO = {"ttft_ms": 3000.0, "tpot_ms": 150.0}
ENGINE = {"num_kv_blocks": 1024, "max_num_batched_tokens": 512}
REPLAN = {"replan_interval_s": 3.0, "replan_window_s": 15.0, "replan_hold_s": 20.0}
POOL = {"num_cpus_per_worker": 0.5}
VOCAB = (1000, 40000)  # prompt token ids are drawn from here


@dataclass
class Sent:
    """One request of the trace and what came back."""

    index: int
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # seconds since the run started, per message
    counts: list[int] = field(default_factory=list)  # tokens per message
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and len(self.tokens) == self.max_tokens

    def ttft_ms(self) -> float:
        return (self.times[0] - self.arrival_s) * 1e3

    def tpot_ms(self) -> float:
        return (self.times[-1] - self.times[0]) * 1e3 / max(1, len(self.tokens) - 1)

    def meets(self) -> bool:
        return self.ok and self.ttft_ms() <= SLO["ttft_ms"] and self.tpot_ms() <= SLO["tpot_ms"]

    def gaps(self) -> list[tuple[float, float]]:
        """(when, seconds since the message before) of every message after the first."""
        return [(t, t - s) for s, t in zip(self.times, self.times[1:])]


# ---- the workload -------------------------------------------------------------------------------
def config(prefill: int, decode: int, **extra) -> ServingConfig:
    return ServingConfig.from_dict(
        {"mode": "disaggregated", "engine": ENGINE, "prefill": {"num_instances": prefill},
         "decode": {"num_instances": decode}, "slo": SLO, **extra}
    )  # fmt: skip


def phase_requests(
    phase: str, rate: float, seconds: float, start: float, rng: random.Random, length_scale: float = 1.0
) -> list[SimRequest]:
    (p_lo, p_hi), (o_lo, o_hi) = (scaled(bounds, length_scale) for bounds in PHASES[phase])
    out, t = [], start
    while t < start + seconds:
        out.append(SimRequest(len(out), t, rng.randint(p_lo, p_hi), rng.randint(o_lo, o_hi)))
        t += rng.expovariate(rate)
    return out


def scaled(bounds: tuple[int, int], scale: float) -> tuple[int, int]:
    return max(1, round(bounds[0] * scale)), max(1, round(bounds[1] * scale))


def capacity(phase: str, prefill: int, decode: int, profile, length_scale: float = 1.0) -> float:
    """The highest rate this split serves the phase at with 90% attainment, by the simulator."""
    planned = PlannedDeployment(with_split(config(2, 1), prefill, decode), {"prefill": profile, "decode": profile})
    low, high = 0.05, 20.0
    for _ in range(12):
        mid = math.sqrt(low * high)
        requests = phase_requests(phase, mid, 60.0, 0.0, random.Random(0), length_scale)
        attained = slo_attainment(planned.simulator().run(requests), SLO["ttft_ms"], SLO["tpot_ms"])
        low, high = (mid, high) if attained >= 90 else (low, mid)
    return low


def trace(
    phase_s: float, load: float, profile, capacities: dict[str, float | None], length_scale: float = 1.0
) -> tuple[list[SimRequest], dict]:
    """`capacities`: each phase's best static capacity (req/s), measured; None: the simulator's."""

    def best(phase: str) -> float:
        return max(capacity(phase, 2, 1, profile, length_scale), capacity(phase, 1, 2, profile, length_scale))

    rates = {phase: load * (capacities.get(phase) or best(phase)) for phase in PHASES}
    rng, requests = random.Random(1), []
    for k, phase in enumerate(ORDER):
        requests += phase_requests(phase, rates[phase], phase_s, k * phase_s, rng, length_scale)
    return [SimRequest(i, r.arrival_s, r.prompt_len, r.output_len) for i, r in enumerate(requests)], rates


# ---- a run --------------------------------------------------------------------------------------
async def replay(address: str, requests: list[Sent], paced: bool) -> float:
    """Sends every request at its arrival time (or all at once, `paced` False, at most 24 in
    flight); returns the run's start (time.time())."""
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), 30)
        stub = serving_pb2_grpc.ServingStub(channel)
        started, wall = time.perf_counter(), time.time()
        slots = asyncio.Semaphore(24 if not paced else 10**6)

        async def one(req: Sent) -> None:
            if paced:
                await asyncio.sleep(max(0.0, started + req.arrival_s - time.perf_counter()))
            async with slots:
                if not paced:
                    req.arrival_s = time.perf_counter() - started
                message = generate_request(
                    prompt_token_ids=req.prompt, max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True
                )
                try:
                    async for msg in stub.Generate(message, timeout=600):
                        if msg.token_ids:
                            req.tokens += msg.token_ids
                            req.times.append(time.perf_counter() - started)
                            req.counts.append(len(msg.token_ids))
                except grpc.aio.AioRpcError as exc:
                    req.error = f"{exc.code().name}: {exc.details()}"

        await asyncio.gather(*(one(r) for r in requests))
        return wall


def fresh(requests: list[SimRequest]) -> list[Sent]:
    rng = random.Random(7)
    return [Sent(r.index, r.arrival_s, [rng.randrange(*VOCAB) for _ in range(r.prompt_len)], r.output_len)
            for r in requests]  # fmt: skip


def metric(url: str, prefix: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def run(name: str, requests: list[Sent], args, paced: bool = True, **overrides) -> dict:
    print(f"[{name}] starting", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        dep = Deployment(
            Path(tmp), args.config, engine=ENGINE, slo=SLO, threads_per_worker=1, calibration_s=args.calibration_s,
            **overrides,
        )  # fmt: skip
        try:
            started = asyncio.run(replay(dep.address, requests, paced))
            with DisaggClient(dep.address) as client:
                status = client.cluster_status()
            recomputed = metric(dep.metrics_url, "disagg:request_migrations_total{")
            moved = metric(dep.metrics_url, 'disagg:live_moves_total{outcome="moved"}')
        finally:
            dep.stop()
    decisions = [d for d in status.replan_decisions if d.switched_instance]
    switches = sorted(
        ({"decided": d.unix_time - started, "seconds": d.switch_seconds, "outcome": d.switch_outcome,
          "from": d.current, "to": d.best, "instance": d.switched_instance} for d in decisions),
        key=lambda s: s["decided"],
    )  # fmt: skip
    print(f"[{name}] done: {sum(r.ok for r in requests)}/{len(requests)} ok, switches {switches}", file=sys.stderr)
    return {"requests": requests, "switches": switches, "recomputed": recomputed, "moved": moved}


# ---- figures ------------------------------------------------------------------------------------
def goodput(requests: list[Sent], duration: float) -> float:
    return sum(r.meets() for r in requests) / duration


def attainment(requests: list[Sent]) -> float:
    return 100.0 * sum(r.meets() for r in requests) / len(requests) if requests else 100.0


def phase_of(arrival_s: float, phase_s: float) -> int:
    return min(len(ORDER) - 1, int(arrival_s // phase_s))


def settle_times(switches: list[dict], phase_s: float) -> dict[int, float]:
    """Phase index -> seconds from its start to its switch done (phases after the first)."""
    settled = {}
    for k in range(1, len(ORDER)):
        done = [s for s in switches if s["outcome"] == "done" and k * phase_s <= s["decided"] < (k + 1) * phase_s]
        if done:
            settled[k] = done[0]["decided"] + done[0]["seconds"] - k * phase_s
    return settled


def pauses_ms(requests: list[Sent], switches: list[dict]) -> list[float]:
    """Per request decoding through a decode instance's drain: its longest gap between tokens in
    the drain's span, less its median gap (what the move stalled it beyond a step)."""
    out = []
    for s in (s for s in switches if s["from"].endswith(":2D") and s["outcome"] == "done"):
        begin, end = s["decided"], s["decided"] + s["seconds"]
        for r in requests:
            gaps = r.gaps()
            inside = [g for t, g in gaps if begin <= t <= end + 0.5]
            if inside and len(gaps) >= 4:
                out.append(max(0.0, (max(inside) - statistics.median(g for _, g in gaps)) * 1e3))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase-s", type=float, default=60.0)
    p.add_argument("--load", type=float, default=0.8, help="of the best static split's capacity in each phase")
    p.add_argument("--prefill-capacity", type=float, help="req/s: the prefill-heavy phase's measured best capacity")
    p.add_argument("--decode-capacity", type=float, help="req/s: the decode-heavy phase's measured best capacity")
    p.add_argument("--length-scale", type=float, default=1.0, help="scales every phase's prompt and output lengths")
    p.add_argument("--calibration-s", type=float, default=30.0, help="each server's start-up calibration (0: none)")
    p.add_argument("--json", help="write every figure here too")
    add_config_argument(p)
    args = p.parse_args(argv)
    profile = load_profile(PROFILE)
    measured = {"prefill-heavy": args.prefill_capacity, "decode-heavy": args.decode_capacity}
    workload, rates = trace(args.phase_s, args.load, profile, measured, args.length_scale)
    duration = len(ORDER) * args.phase_s
    print(f"trace: {len(workload)} requests; rates (req/s) {json.dumps({k: round(v, 2) for k, v in rates.items()})}")
    simulated = replan_report(
        config(2, 1), {"prefill": profile, "decode": profile}, workload,
        interval_s=REPLAN["replan_interval_s"], window_s=REPLAN["replan_window_s"], hold_s=REPLAN["replan_hold_s"],
    )  # fmt: skip

    runs = {
        "2P:1D": run("static 2P:1D", fresh(workload), args, replan=False, prefill={"num_instances": 2, **POOL},
                     decode={"num_instances": 1, **POOL}),
        "1P:2D": run("static 1P:2D", fresh(workload), args, replan=False, prefill={"num_instances": 1, **POOL},
                     decode={"num_instances": 2, **POOL}),
    }  # fmt: skip
    replanned = run("replan from 2P:1D", fresh(workload), args, prefill={"num_instances": 2, **POOL},
                    decode={"num_instances": 1, **POOL}, replan=True, **REPLAN)  # fmt: skip
    reference = run("colocated reference", fresh(workload), args, paced=False, mode="colocated",
                    colocated={"num_instances": 3, **POOL})  # fmt: skip

    static = {name: goodput(r["requests"], duration) for name, r in runs.items()}
    best_name = max(static, key=static.get)
    replan_goodput = goodput(replanned["requests"], duration)
    settled = settle_times(replanned["switches"], args.phase_s)
    gaps = []
    for k in range(len(ORDER)):
        since = k * args.phase_s + settled.get(k, 0.0)

        def window(reqs, k=k, since=since):
            return [r for r in reqs if phase_of(r.arrival_s, args.phase_s) == k and r.arrival_s >= since]

        best_here = max(attainment(window(r["requests"])) for r in runs.values())
        gaps.append(best_here - attainment(window(replanned["requests"])))
    reference_tokens = {r.index: r.tokens for r in reference["requests"] if r.ok}
    wrong = sum(1 for r in replanned["requests"] if r.ok and reference_tokens.get(r.index, r.tokens) != r.tokens)
    # Refused by admission (RESOURCE_EXHAUSTED: predicted to miss, or the in-flight limit) is the
    # goodput policy shedding load, a miss; lost is any other failure.
    refused = {name: sum(r.error.startswith("RESOURCE_EXHAUSTED") for r in run_["requests"])
               for name, run_ in {**runs, "replan": replanned}.items()}  # fmt: skip
    lost = sum(1 for r in replanned["requests"] if not r.ok and not r.error.startswith("RESOURCE_EXHAUSTED"))
    switch_s = [s["seconds"] for s in replanned["switches"] if s["outcome"] == "done"]
    pauses = pauses_ms(replanned["requests"], replanned["switches"])
    steps = [g * 1e3 for r in replanned["requests"] if phase_of(r.arrival_s, args.phase_s) == 1 for _, g in r.gaps()]
    figures = {
        **{f"static {name} goodput": v for name, v in static.items()},
        "best static goodput": static[best_name],
        "replan goodput": replan_goodput,
        "replan goodput ratio": replan_goodput / static[best_name] if static[best_name] else math.inf,
        "phase attainment gap": max(gaps),
        "settle s": max(settled.values()) if settled else math.nan,
        "switch p50 s": statistics.median(switch_s) if switch_s else math.nan,
        "migration pause p50 ms": statistics.median(pauses) if pauses else math.nan,
        "decode step p50 ms": statistics.median(steps) if steps else math.nan,
        "recomputed requests on drain": replanned["recomputed"],
        "moved with their KV": replanned["moved"],
        **{f"refused by admission ({name})": n for name, n in refused.items()},
        "lost": lost,
        "wrong outputs": wrong,
        "reference outputs": len(reference_tokens),
        "flips": len(replanned["switches"]),
        "simulated best static goodput": simulated["best_static_goodput"],
        "simulated replan goodput": simulated["replan_goodput"],
        "simulated replan goodput ratio": simulated["replan_goodput_ratio"],
    }
    for name, value in figures.items():
        print(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}")
    print(f"switches: {json.dumps(replanned['switches'])}")
    print(f"phase attainment gaps (points): {[round(g, 1) for g in gaps]}")
    for name, run_ in {**runs, "replan": replanned}.items():
        by_phase = [attainment([r for r in run_["requests"] if phase_of(r.arrival_s, args.phase_s) == k])
                    for k in range(len(ORDER))]  # fmt: skip
        print(f"attainment by phase, {name}: {[round(a, 1) for a in by_phase]}")
    if args.json:
        rows = {name: [_row(r, args.phase_s) for r in run_["requests"]]
                for name, run_ in {**runs, "replan": replanned}.items()}  # fmt: skip
        everything = {**figures, "switches": replanned["switches"], "rates": rates, "requests": rows}
        Path(args.json).write_text(json.dumps(everything))


def _row(r: Sent, phase_s: float) -> dict:
    timed = bool(r.times)
    return {"arrival_s": round(r.arrival_s, 3), "phase": phase_of(r.arrival_s, phase_s), "ok": r.ok,
            "meets": r.meets(), "error": r.error[:80], "ttft_ms": round(r.ttft_ms(), 1) if timed else None,
            "tpot_ms": round(r.tpot_ms(), 1) if timed else None}  # fmt: skip


if __name__ == "__main__":
    main()
