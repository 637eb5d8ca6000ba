"""The closed loop against every static split, through the real service (issue 36).

Three instances of the default model, one thread each, on this machine (`disagg serve` in its own
process: Ray, redis-server, gRPC on 127.0.0.1). The workload shifts: a prefill-heavy phase (long
prompts, short outputs), a decode-heavy phase (short prompts, long outputs), the prefill-heavy
phase again, each `--phase-s` seconds of Poisson arrivals at `--load` (0.8) of the best static
split's capacity for that phase (`--trace balanced`, issue 53: prefill-heavy then decode-heavy,
the same number of requests in each, at one rate: balanced_trace; it prints `balanced replan
goodput ratio`), measured first in the same run (disagg.bench.capacity: each
static split served, each phase's requests sent by enough closed-loop streams to saturate it, no
refusals), so that the load means the same on a fast host and a slow one; `--prefill-capacity`,
`--decode-capacity` (req/s) give an earlier run's instead. Both are printed. The SLO: TTFT 3 s,
TPOT 150 ms (the balanced trace's 60 ms: TARGETS says why; `--tpot-ms` sets another).

The same requests (random prompt token ids, greedy) run on 2P:1D and 1P:2D with re-planning off,
on 2P:1D with re-planning on (it must move an instance at each phase change), and on a
colocated deployment of three instances with no time pressure (the reference outputs). Prints,
one per line: each static split's goodput, the best, the re-planning run's and their ratio; the
phase attainment gap (the largest shortfall, in points, of re-planning against the best static
split of each phase, counted from the moment its switch was done, or the phase's start where no
switch was due); settle s (phase change to switch done); switch p50 s (drain start to serving
in the new role); the migration pause (a moved request's longest gap between tokens during the
drain, less its median gap) against the decode step (the median gap between tokens); recomputed
tokens, lost and wrong outputs; flips; each switch's check (issue 53: predicted beside measured,
kept or undone, and the share whose measured effect had the predicted sign); and the simulator's
replay of the same arrivals under the server's own policy (disagg.planner.replan_sim), its ratio
and that ratio over the measured one.

    .venv/bin/python -m loadtest.planner.replan [--phase-s 60] [--load 0.8] [--trace balanced] [--tpot-ms T] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from disagg.bench.capacity import add_load_argument, measure_capacity
from disagg.bench.launcher import Deployment, add_config_argument
from disagg.bench.load_client import GrpcApi, LoadRequest, open_loop, run_loop
from disagg.bench.metrics import RequestRecord
from disagg.bench.results import host_line, write_results
from disagg.bench.slo_tally import SloTally
from disagg.client import DisaggClient, generate_request
from disagg.config import ServingConfig
from disagg.placement.profile import load_profile
from disagg.planner.replan_sim import replan_report
from disagg.planner.workload import SimRequest
from disagg.slo import SLO, met

PROFILE = "deploy/profiles/smollm2-135m-cpu-1t.json"
PHASES = {"prefill-heavy": ((700, 900), (4, 8)), "decode-heavy": ((20, 40), (150, 200))}
# The traces: their phases in order. "shifting" (the default) runs each phase at `--load` of its own best
# static capacity; "balanced" (issue 53) sends the same number of requests in each phase (see balanced_trace).
TRACES = {"shifting": ("prefill-heavy", "decode-heavy", "prefill-heavy"), "balanced": ("prefill-heavy", "decode-heavy")}
# Each trace's SLO. The balanced trace's TPOT is tighter: at 150 ms one decode instance meets every
# request of a decode-heavy phase at any rate the prefill-heavy phase can carry on this host (its step
# stays under 100 ms), so no split would be short of decode there and its phase could not pay for a switch.
TARGETS = {"shifting": SLO(ttft_ms=3000.0, tpot_ms=150.0), "balanced": SLO(ttft_ms=3000.0, tpot_ms=60.0)}
ENGINE = {"num_kv_blocks": 1024, "max_num_batched_tokens": 512}
# Against static splits of the same three instances: the loop switches, it does not scale (issue 53 item 3).
REPLAN = {"replan_interval_s": 3.0, "replan_window_s": 15.0, "replan_hold_s": 20.0, "replan_scale": False}
POOL = {"num_cpus_per_worker": 0.5}
VOCAB = (1000, 40000)  # prompt token ids are drawn from here
SPLITS = {"2P:1D": (2, 1), "1P:2D": (1, 2)}  # the static splits of three instances
# Closed-loop streams that saturate a split on each phase's requests (its batches full), and
# how many requests the capacity is measured with.
CAPACITY_STREAMS = {"prefill-heavy": 8, "decode-heavy": 24}


@dataclass
class Sent:
    """One request of the trace: when it was due, and what came back (its load-client record)."""

    index: int
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    record: RequestRecord | None = None

    @property
    def tokens(self) -> list[int]:
        return self.record.token_ids if self.record else []

    @property
    def times(self) -> list[float]:
        """When each token arrived, seconds since the run started."""
        return self.record.token_times if self.record else []

    @property
    def error(self) -> str:
        record = self.record
        return "" if record is None or record.success else f"{record.error_code}: {record.error}"

    @property
    def ok(self) -> bool:
        return self.record is not None and self.record.success and len(self.tokens) == self.max_tokens

    def ttft_ms(self) -> float:
        return self.record.ttft * 1e3

    def tpot_ms(self) -> float:
        return self.record.tpot * 1e3

    def meets(self, targets: SLO) -> bool:
        return self.ok and met(targets, self.ttft_ms(), self.tpot_ms())

    def gaps(self) -> list[tuple[float, float]]:
        """(when, seconds since the message before) of every message after the first."""
        return [(t, t - s) for s, t in zip(self.times, self.times[1:]) if t > s]


# ---- the workload -------------------------------------------------------------------------------
def config(prefill: int, decode: int, targets: SLO, **extra) -> ServingConfig:
    return ServingConfig.from_dict(
        {"mode": "disaggregated", "engine": ENGINE, "prefill": {"num_instances": prefill},
         "decode": {"num_instances": decode}, "slo": targets.to_dict(), **extra}
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


def counted_requests(
    phase: str, count: int, seconds: float, start: float, rng: random.Random, scales: tuple[float, float]
) -> list[SimRequest]:
    """Exactly `count` requests of the phase over `seconds` from `start` (Poisson arrivals given
    their number: uniform times, sorted); `scales`: its prompt and output lengths'."""
    (p_lo, p_hi), (o_lo, o_hi) = (scaled(bounds, k) for bounds, k in zip(PHASES[phase], scales))
    times = sorted(start + rng.uniform(0.0, seconds) for _ in range(count))
    return [SimRequest(i, t, rng.randint(p_lo, p_hi), rng.randint(o_lo, o_hi)) for i, t in enumerate(times)]


def phase_lengths(phase: str, n: int, rng: random.Random, length_scale: float = 1.0) -> list[SimRequest]:
    """`n` requests of the phase's lengths, all due at once."""
    (p_lo, p_hi), (o_lo, o_hi) = (scaled(bounds, length_scale) for bounds in PHASES[phase])
    return [SimRequest(i, 0.0, rng.randint(p_lo, p_hi), rng.randint(o_lo, o_hi)) for i in range(n)]


def scaled(bounds: tuple[int, int], scale: float) -> tuple[int, int]:
    return max(1, round(bounds[0] * scale)), max(1, round(bounds[1] * scale))


def split_settings(prefill: int, decode: int, args, **extra) -> dict:
    pools = {"prefill": {"num_instances": prefill, **POOL}, "decode": {"num_instances": decode, **POOL}}
    return {"engine": ENGINE, "slo": args.targets.to_dict(), "threads_per_worker": 1,
            "calibration_s": args.calibration_s, **pools, **extra}  # fmt: skip


def measured_capacities(phases: list[str], args) -> dict[str, float]:
    """Each phase's best static capacity (req/s): every split served in turn (refusing nothing,
    so that what it completes is what it can), each phase's requests (prompts of their own) sent
    by closed-loop streams enough to saturate it."""
    best: dict[str, float] = {}
    for name, (prefill, decode) in SPLITS.items():
        settings = split_settings(prefill, decode, args, replan=False, slo_admission="best_effort")
        with Deployment(settings, base=args.config, name="replan-capacity") as dep:
            for phase in phases:
                lengths = phase_lengths(phase, args.capacity_requests, random.Random(2), args.length_scale)
                requests = [LoadRequest(_message(r), len(r.prompt)) for r in fresh(lengths)]
                found = run_loop(GrpcApi(dep.address), measure_capacity, requests, CAPACITY_STREAMS[phase])
                print(f"capacity of {name} on {phase}: {found.requests_per_s:.3f} req/s", flush=True)
                best[phase] = max(best.get(phase, 0.0), found.requests_per_s)
    return best


def trace(
    phase_s: float, load: float, capacities: dict[str, float], length_scale: float = 1.0
) -> tuple[list[SimRequest], dict]:
    """The shifting trace; `capacities`: each phase's best static capacity (req/s)."""
    rates = {phase: load * capacities[phase] for phase in PHASES}
    rng, requests = random.Random(1), []
    for k, phase in enumerate(TRACES["shifting"]):
        requests += phase_requests(phase, rates[phase], phase_s, k * phase_s, rng, length_scale)
    return numbered(requests), rates


def balanced_trace(
    phase_s: float, load: float, capacities: dict[str, float], length_scale: float = 1.0
) -> tuple[list[SimRequest], dict]:
    """Prefill-heavy then decode-heavy, `phase_s` each, the same number of requests in each: both
    at `load` of the prefill-heavy phase's best capacity. So that the same rate asks as much of
    the decode side, the decode-heavy outputs are longer by the ratio of the phases' capacities
    (a request's decode time grows with its output): each phase then runs at `load` of its best
    split's capacity, as in the shifting trace, and in each the other split is short of it."""
    rate = load * capacities["prefill-heavy"]
    count = max(1, round(rate * phase_s))
    stretch = max(1.0, capacities["decode-heavy"] / capacities["prefill-heavy"])
    rng = random.Random(1)
    requests = counted_requests("prefill-heavy", count, phase_s, 0.0, rng, (length_scale, length_scale))
    requests += counted_requests("decode-heavy", count, phase_s, phase_s, rng, (length_scale, length_scale * stretch))
    return numbered(requests), {"prefill-heavy": rate, "decode-heavy": rate, "decode output stretch": stretch}


def numbered(requests: list[SimRequest]) -> list[SimRequest]:
    return [SimRequest(i, r.arrival_s, r.prompt_len, r.output_len) for i, r in enumerate(requests)]


# ---- a run --------------------------------------------------------------------------------------
def _message(req):
    return generate_request(prompt_token_ids=req.prompt, max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)


def replay(address: str, requests: list[Sent], paced: bool) -> float:
    """Sends every request at its arrival time (or all at once, `paced` False, at most 24 in
    flight); returns the run's start (time.time())."""
    sent = [LoadRequest(_message(r), len(r.prompt)) for r in requests]
    arrivals = [r.arrival_s for r in requests] if paced else [0.0] * len(requests)
    run = run_loop(GrpcApi(address), open_loop, sent, arrivals, None if paced else 24)
    for req, record in zip(requests, run.records):
        req.record = record
        if not paced:
            req.arrival_s = record.sent_at
    return run.started_at


def fresh(requests: list[SimRequest]) -> list[Sent]:
    """The requests with prompts of random token ids (none shares a prefix with another run's)."""
    rng = random.Random(7)
    return [Sent(r.index, r.arrival_s, [rng.randrange(*VOCAB) for _ in range(r.prompt_len)], r.output_len)
            for r in requests]  # fmt: skip


def run(name: str, requests: list[Sent], args, paced: bool = True, **settings) -> dict:
    print(f"[{name}] starting", file=sys.stderr, flush=True)
    base = {
        "engine": ENGINE,
        "slo": args.targets.to_dict(),
        "threads_per_worker": 1,
        "calibration_s": args.calibration_s,
    }
    log = Path(args.logs) / f"{name.replace(' ', '-').replace(':', '')}.log" if args.logs else None
    with Deployment({**base, **settings}, base=args.config, name="replan", log=log) as dep:
        started = replay(dep.address, requests, paced)
        with DisaggClient(dep.address) as client:
            status = client.cluster_status()
        recomputed = dep.metric("disagg:request_migrations_total{")
        moved = dep.metric('disagg:live_moves_total{outcome="moved"}')
    decisions = [d for d in status.replan_decisions if d.switched_instance]
    checks = [_check(d) for d in status.replan_decisions if d.check_outcome and not d.reason.startswith("undo")]
    switches = sorted(
        ({"decided": d.unix_time - started, "seconds": d.switch_seconds, "outcome": d.switch_outcome,
          "from": d.current, "to": d.best, "instance": d.switched_instance} for d in decisions),
        key=lambda s: s["decided"],
    )  # fmt: skip
    print(f"[{name}] done: {sum(r.ok for r in requests)}/{len(requests)} ok, switches {switches}", file=sys.stderr)
    # What the loop's live-state pricing said each round (the latest 64): when, best, its gain over current.
    rounds = sorted((round(d.unix_time - started, 1), d.current, d.best, round(d.predicted_gain, 1), d.reason[:48])
                    for d in status.replan_decisions)  # fmt: skip
    return {"requests": requests, "switches": switches, "recomputed": recomputed, "moved": moved, "checks": checks,
            "rounds": rounds}  # fmt: skip


def _check(d) -> dict:
    """A switch's check as the server showed it (issue 53): predicted beside measured."""
    return {"outcome": d.check_outcome, "from": d.current, "to": d.best,
            "predicted attainment": round(d.predicted_attainment, 1),
            "predicted staying": round(d.predicted_stay_attainment, 1),
            "measured attainment": round(d.measured_attainment, 1), "staying (estimated)": round(d.stay_attainment, 1),
            "predicted goodput": round(d.predicted_goodput, 3), "measured goodput": round(d.measured_goodput, 3)}  # fmt: skip


def sign_share(checks: list[dict]) -> float:
    """Of the checks closed, the share whose measured effect (against staying) had the sign predicted."""
    closed = [c for c in checks if c["outcome"] in ("kept", "undone")]
    right = [(c["measured attainment"] >= c["staying (estimated)"]) == (c["predicted attainment"] >= c["predicted staying"])
             for c in closed]  # fmt: skip
    return sum(right) / len(right) if right else math.nan


# ---- figures ------------------------------------------------------------------------------------
def tally(requests: list[Sent], targets: SLO) -> SloTally:
    """The requests judged by the SLO (disagg.slo.met; a failure, or an output cut short, misses)."""
    counted = SloTally(targets)
    for r in requests:
        counted.add(r.record if r.ok else RequestRecord(r.index, len(r.prompt), r.max_tokens, error_code="SHORT"))
    return counted


def goodput(requests: list[Sent], duration: float, targets: SLO) -> float:
    return tally(requests, targets).goodput(duration)


def attainment(requests: list[Sent], targets: SLO) -> float:
    return tally(requests, targets).attainment_pct if requests else 100.0


def best_by_phase(runs: dict[str, dict], phase_s: float, phases: int, targets: SLO) -> int:
    """The requests that met the SLO, each phase counted on the static split that met the most in it."""

    def met_in(requests: list[Sent], k: int) -> int:
        return sum(r.meets(targets) for r in requests if phase_of(r.arrival_s, phase_s, phases) == k)

    return sum(max(met_in(run_["requests"], k) for run_ in runs.values()) for k in range(phases))


def phase_of(arrival_s: float, phase_s: float, phases: int = 3) -> int:
    return min(phases - 1, int(arrival_s // phase_s))


def settle_times(switches: list[dict], phase_s: float, phases: int = 3) -> dict[int, float]:
    """Phase index -> seconds from its start to its switch done (phases after the first)."""
    settled = {}
    for k in range(1, phases):
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase-s", type=float, default=60.0)
    p.add_argument("--trace", choices=sorted(TRACES), default="shifting", help="balanced: as many requests each phase")
    add_load_argument(p, 0.8, "each phase's rate, of the best static split's capacity in that phase")
    p.add_argument("--prefill-capacity", type=float, help="req/s: the prefill-heavy phase's (an earlier run's)")
    p.add_argument("--decode-capacity", type=float, help="req/s: the decode-heavy phase's (an earlier run's)")
    p.add_argument("--capacity-requests", type=int, default=24, help="requests each capacity is measured with")
    p.add_argument("--length-scale", type=float, default=1.0, help="scales every phase's prompt and output lengths")
    p.add_argument("--calibration-s", type=float, default=30.0, help="each server's start-up calibration (0: none)")
    p.add_argument("--tpot-ms", type=float, help="the SLO's TPOT target (default: the trace's, TARGETS)")
    p.add_argument("--json", help="write every figure here too")
    p.add_argument("--logs", help="keep each run's server log in this folder (a switch's, a drain's story)")
    add_config_argument(p)
    args = p.parse_args(argv)
    slo = TARGETS[args.trace]
    args.targets = SLO(slo.ttft_ms, args.tpot_ms or slo.tpot_ms)
    print(host_line(), flush=True)
    profile = load_profile(PROFILE)
    capacities = {"prefill-heavy": args.prefill_capacity, "decode-heavy": args.decode_capacity}
    unknown = [phase for phase, found in capacities.items() if found is None]
    capacities.update(measured_capacities(unknown, args) if unknown else {})
    build = balanced_trace if args.trace == "balanced" else trace
    workload, rates = build(args.phase_s, args.load, capacities, args.length_scale)
    phases = len(TRACES[args.trace])
    duration = phases * args.phase_s
    for phase, capacity in capacities.items():
        print(f"{phase}: capacity {capacity:.3f} req/s; rate {rates[phase]:.3f} req/s (load {args.load:g})", flush=True)
    print(
        f"trace: {len(workload)} requests; rates (req/s) {json.dumps({k: round(v, 2) for k, v in rates.items()})}; "
        f"SLO: TTFT {args.targets.ttft_ms:g} ms, TPOT {args.targets.tpot_ms:g} ms"
    )
    # The same arrivals replayed in the simulator under the server's own policy (disagg.planner.replan_sim).
    simulated = replan_report(
        config(2, 1, args.targets), {"prefill": profile, "decode": profile}, workload,
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
    # Every request of the reference must be served (none refused as late): its outputs are what the others' are compared to.
    reference = run("colocated reference", fresh(workload), args, paced=False, mode="colocated",
                    colocated={"num_instances": 3, **POOL}, slo_admission="best_effort")  # fmt: skip

    static = {name: goodput(r["requests"], duration, args.targets) for name, r in runs.items()}
    best_name = max(static, key=static.get)
    replan_goodput = goodput(replanned["requests"], duration, args.targets)
    settled = settle_times(replanned["switches"], args.phase_s, phases)
    gaps = []
    for k in range(phases):
        since = k * args.phase_s + settled.get(k, 0.0)

        def window(reqs, k=k, since=since):
            return [r for r in reqs if phase_of(r.arrival_s, args.phase_s, phases) == k and r.arrival_s >= since]

        best_here = max(attainment(window(r["requests"]), args.targets) for r in runs.values())
        gaps.append(best_here - attainment(window(replanned["requests"]), args.targets))
    reference_tokens = {r.index: r.tokens for r in reference["requests"] if r.ok}
    wrong = sum(1 for r in replanned["requests"] if r.ok and reference_tokens.get(r.index, r.tokens) != r.tokens)
    # Refused by admission (RESOURCE_EXHAUSTED: predicted to miss, or the in-flight limit) is the
    # goodput policy shedding load, a miss; lost is any other failure.
    refused = {name: sum(r.error.startswith("RESOURCE_EXHAUSTED") for r in run_["requests"])
               for name, run_ in {**runs, "replan": replanned}.items()}  # fmt: skip
    lost = sum(1 for r in replanned["requests"] if not r.ok and not r.error.startswith("RESOURCE_EXHAUSTED"))
    switch_s = [s["seconds"] for s in replanned["switches"] if s["outcome"] == "done"]
    pauses = pauses_ms(replanned["requests"], replanned["switches"])
    steps = [g * 1e3 for r in replanned["requests"] if phase_of(r.arrival_s, args.phase_s, phases) == 1
             for _, g in r.gaps()]  # fmt: skip
    ratio = replan_goodput / static[best_name] if static[best_name] else math.inf
    phase_best = best_by_phase(runs, args.phase_s, phases, args.targets) / duration
    figures = {
        **{f"static {name} goodput": v for name, v in static.items()},
        "best static goodput": static[best_name],
        "replan goodput": replan_goodput,
        f"{'balanced ' if args.trace == 'balanced' else ''}replan goodput ratio": ratio,
        # What a free switch to each phase's best static split at its start would give, were each phase to
        # run as it did there (not a bound: a phase inherits the one before's backlog, which a switch changes).
        "phase-best static ratio": phase_best / static[best_name] if static[best_name] else math.inf,
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
        "simulated / measured replan goodput ratio": simulated["replan_goodput_ratio"] / ratio if ratio else math.inf,
        "switches checked": sum(c["outcome"] in ("kept", "undone") for c in replanned["checks"]),
        "switches undone": sum(c["outcome"] == "undone" for c in replanned["checks"]),
        "checked switches with the predicted sign": sign_share(replanned["checks"]),
    }
    for name, value in figures.items():
        print(f"{name}: {value:.3f}" if isinstance(value, float) else f"{name}: {value}")
    print(f"switches: {json.dumps(replanned['switches'])}")
    print(f"checks: {json.dumps(replanned['checks'])}")
    print(f"loop rounds (s, current, best, gain, reason): {json.dumps(replanned['rounds'])}")
    print(f"phase attainment gaps (points): {[round(g, 1) for g in gaps]}")
    for name, run_ in {**runs, "replan": replanned}.items():
        by_phase = [attainment([r for r in run_["requests"] if phase_of(r.arrival_s, args.phase_s, phases) == k],
                               args.targets)
                    for k in range(phases)]  # fmt: skip
        print(f"attainment by phase, {name}: {[round(a, 1) for a in by_phase]}")
    if args.json:
        rows = {name: [_row(r, args.phase_s, phases, args.targets) for r in run_["requests"]]
                for name, run_ in {**runs, "replan": replanned}.items()}  # fmt: skip
        rates = {"rates": rates, "capacities": capacities, "load": args.load}
        write_results(args.json, {**figures, "switches": replanned["switches"], **rates, "requests": rows}, args)
    return 0


def _row(r: Sent, phase_s: float, phases: int, targets: SLO) -> dict:
    timed = bool(r.record and r.record.success)
    return {"arrival_s": round(r.arrival_s, 3), "phase": phase_of(r.arrival_s, phase_s, phases), "ok": r.ok,
            "meets": r.meets(targets), "error": r.error[:80], "ttft_ms": round(r.ttft_ms(), 1) if timed else None,
            "tpot_ms": round(r.tpot_ms(), 1) if timed else None}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
