"""The goodput-aware router against least outstanding work, on the real server (issue 25).

Phases, each on a fresh `disagg serve` (the default deployment: 1 prefill + 1 decode worker,
SmolLM2-135M, the chat workload's lengths scaled to this CPU):

1. goodput policy, no SLO: calibrate (the instances' models fit from their own steps), measure
   the unloaded TTFT/TPOT and the capacity (req/s at saturation: disagg.bench.capacity), then an
   open-loop run at half the capacity: predicted (the router's, in each response's Timings) against measured TTFT and
   TPOT -> `ttft mape`, `tpot mape`.
2. the SLO is set from the unloaded figures (TTFT x SLO_TTFT_FACTOR, TPOT x SLO_TPOT_FACTOR);
   each policy on its own server at 2x and 3x the capacity, open loop: goodput (requests meeting
   both SLOs per second) -> `overload 2x goodput ratio`, `overload 3x goodput ratio` (goodput
   policy / least work), `admitted attainment` (goodput policy, both rates), and how fast
   refusals answer. Each run is replayed in the simulator (disagg.planner) with the same policy
   class, this CPU's 1-thread profile and the same arrivals: simulated against measured
   attainment of the goodput policy's runs, within the planner's tolerance of 5 points ->
   `simulated attainment error`.

3. prefix: 2 prefill instances (each KV cache holding half of the prefixes) + 1 decode
   instance; requests are one of PREFIXES long shared documents followed by a short question;
   each policy on its own server at the same open-loop rate -> `prefix ttft ratio` (TTFT p50,
   goodput policy / least work: least work spreads each prefix over both caches, which then
   evict each other's).
4. conditional disaggregation: 1 prefill + 1 decode instance, short chat prompts, the goodput
   policy with `local_prefill_max_tokens` against always disaggregating (0), same rate and SLO
   -> `conditional ttft ratio` (TTFT p50, conditional / always), and both TPOT attainments.

5. heterogeneity: 2 prefill instances of unequal speed (1 and 2 torch threads, per-instance
   settings) + 1 decode instance, mixed prompt lengths (chat and code prompts alternating), the
   SLO from this deployment's unloaded latencies (`heterogeneity_phase`); each policy on its
   own server swept over open-loop rates. A policy's goodput is
   DistServe's: the highest rate at which at least 90% of requests meet both SLOs (linear between
   the rates swept) -> `heterogeneity goodput ratio` (goodput policy / least work).

    .venv/bin/python -m loadtest.router.policies          # ~45 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from disagg.bench.capacity import measure_capacity
from disagg.bench.launcher import Deployment, add_config_argument
from disagg.bench.load_client import GrpcApi, load_requests, run_loop
from disagg.bench.metrics import RequestRecord
from disagg.bench.open_loop import LoadConfig, run_benchmark
from disagg.bench.results import host_line, write_results
from disagg.bench.slo_tally import SloTally
from disagg.bench.workloads import WorkloadConfig, load_tokenizer, make_workload
from disagg.config import DEFAULT_MODEL, ServingConfig
from disagg.placement.profile import load_profile
from disagg.planner.deployment import Deployment as PlannedDeployment
from disagg.planner.simulator import num_met
from disagg.planner.workload import SimRequest
from disagg.slo import SLO, met

SLO_TTFT_FACTOR, SLO_TPOT_FACTOR = 4.0, 2.0
PROFILE = "deploy/profiles/smollm2-135m-cpu-1t.json"  # this CPU, one thread per worker
MAX_OUTPUT = 24


def workload(num: int, seed: int):
    tokenizer, _ = load_tokenizer(DEFAULT_MODEL)
    requests = make_workload(WorkloadConfig("chat", num, seed=seed, length_scale=0.5), tokenizer)
    return [r.__class__(r.prompt, r.prompt_len, min(r.output_len, MAX_OUTPUT)) for r in requests]


def run(address, requests, rate, duration_s=None, num=None, concurrency=None, slo=None) -> dict:
    load = LoadConfig(request_rate=rate, num_requests=num, duration_s=duration_s, max_concurrency=concurrency,
                      timeout_s=120.0)  # fmt: skip
    return run_benchmark(address, requests, load, slo)


def _few(args, num: int) -> int:
    """`num` requests of a phase's unmeasured or unloaded run; 2 with --smoke."""
    return min(num, 2) if args.smoke else num


def mape(pairs: list[tuple[float, float]]) -> float:
    errors = [abs(p - m) / m for p, m in pairs if m > 0 and p > 0]
    return 100.0 * float(np.median(errors)) if errors else math.nan  # median absolute percentage error


def tally(records: list[dict], slo: SLO) -> SloTally:
    """The requests of a run's result (dicts, as saved) judged by `slo`."""
    counted = SloTally(slo)
    for r in records:
        counted.add(RequestRecord.from_dict(r))
    return counted


def prediction_phase(requests, args) -> dict:
    with Deployment({"replan": False, "placement": "goodput"}, base=args.config) as dep:
        run(dep.address, requests, math.inf, num=_few(args, 24), concurrency=2)  # calibration
        base = run(dep.address, requests, math.inf, num=_few(args, 12), concurrency=1)["summary"]
        api = GrpcApi(dep.address, timeout_s=120.0)
        sat = run_loop(api, measure_capacity, load_requests(requests[: args.capacity_requests]), 16)
        capacity = sat.requests_per_s
        print(f"capacity {capacity:.3f} req/s; moderate load 0.5 x capacity = {capacity / 2:.3f} req/s", flush=True)
        moderate = run(dep.address, requests, capacity / 2, duration_s=args.seconds)
    ok = [r for r in moderate["requests"] if r["success"]]
    ttft = [(r["server"].get("predicted_ttft_s", 0.0), r["ttft"]) for r in ok]
    tpot = [(r["server"].get("predicted_tpot_s", 0.0), r["tpot"]) for r in ok if r["output_len"] > 1]
    return {
        "base_ttft_ms": base["ttft_ms"]["p50"], "base_tpot_ms": base["tpot_ms"]["p50"],
        "capacity_rps": capacity, "moderate_rps": capacity / 2, "moderate_completed": len(ok),
        "ttft_mape": mape(ttft), "tpot_mape": mape(tpot),
        "ttft_pairs_ms": [(round(p * 1e3, 1), round(m * 1e3, 1)) for p, m in ttft],  # predicted, measured
        "requests": [_prediction_row(r) for r in ok], "requests_columns": PREDICTION_COLUMNS,
    }  # fmt: skip


PREDICTION_COLUMNS = ("sent_s", "prompt_len", "output_len", "predicted_ttft_ms", "ttft_ms", "server_ttft_ms",
                      "predicted_tpot_ms", "tpot_ms")  # fmt: skip


def _prediction_row(r: dict) -> list:
    """Where a prediction's error comes from: the request's lengths and when it came, predicted
    against measured (by the client, and TTFT by the server too)."""
    server = r["server"]
    ms = lambda s: round(s * 1e3, 1)  # noqa: E731
    return [round(r["sent_at"], 3), r["prompt_len"], r["output_len"], ms(server.get("predicted_ttft_s", 0.0)),
            ms(r["ttft"]), ms(server.get("ttft_s", 0.0)), ms(server.get("predicted_tpot_s", 0.0)), ms(r["tpot"])]  # fmt: skip


def overload_phase(requests, policy: str, slo: SLO, capacity: float, base_ttft_ms: float, args) -> dict:
    results = {}
    with Deployment({"replan": False, "placement": policy, "slo": slo.to_dict()}, base=args.config) as dep:
        run(dep.address, requests, math.inf, num=_few(args, 24), concurrency=2)  # calibration, as above
        for factor in (2, 3):
            print(f"{policy}: {factor} x capacity = {factor * capacity:.3f} req/s", flush=True)
            out = run(dep.address, requests, factor * capacity, duration_s=args.seconds, slo=slo)
            records = out["requests"]
            admitted = [r for r in records if r["error_code"] != "RESOURCE_EXHAUSTED"]
            refused = [r for r in records if r["error_code"] == "RESOURCE_EXHAUSTED"]
            results[f"{factor}x"] = {
                "sent": len(records), "admitted": len(admitted), "refused": len(refused),
                "met_slo": tally(admitted, slo).good, "goodput_rps": out["summary"]["goodput"],
                "duration_s": out["summary"]["duration_s"],
                "refusal_ms_p50": _p(refused, 50), "refusal_ms_p99": _p(refused, 99),
                "failures": out["summary"]["failures_by_code"],
                "simulated": simulate(records, policy, slo, base_ttft_ms, args.profile),
            }  # fmt: skip
    return results


def simulate(records: list[dict], policy: str, slo: SLO, base_ttft_ms: float, profile_path: str = PROFILE) -> dict:
    """The run's twin in the simulator: the same arrivals, lengths, policy class and SLO; the
    router's own time (what a profile of the engine cannot know) from the unloaded TTFT."""
    config = ServingConfig.from_dict({"slo": slo.to_dict(), "placement": policy})
    profile = load_profile(profile_path)
    planned = PlannedDeployment(config, {"prefill": profile, "decode": profile})  # its policy: the config's
    start = min(r["sent_at"] for r in records)
    requests = [
        SimRequest(i, r["sent_at"] - start, r["prompt_len"], r["target_output_len"]) for i, r in enumerate(records)
    ]
    (alone,) = planned.simulator().run([SimRequest(0, 0.0, int(np.median([r.prompt_len for r in requests])), 2)])
    planned.router_overhead_ms = max(0.0, base_ttft_ms - alone.ttft_s * 1e3)
    sim = planned.simulator().run(requests)
    refused = sum(r.failed.startswith("refused") for r in sim)
    return {
        "sent": len(sim),
        "refused": refused,
        "met_slo": num_met(sim, slo),
        "router_overhead_ms": planned.router_overhead_ms,
    }


PREFIXES, PREFIX_TOKENS = 16, 400
QUESTIONS = ["Summarize it in one line.", "What is the main point?", "Name one detail.", "Who is it for?"]


def prefix_workload(num: int, seed: int):
    """Each request: one of PREFIXES long documents (the shared prefix), then a short question."""
    tokenizer, _ = load_tokenizer(DEFAULT_MODEL)
    docs = make_workload(WorkloadConfig("summarization", PREFIXES, seed=seed), tokenizer)
    prefixes = [tokenizer.decode(tokenizer.encode(d.prompt)[:PREFIX_TOKENS]) for d in docs]
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(num):
        text = prefixes[int(rng.integers(PREFIXES))] + "\n\n" + QUESTIONS[i % len(QUESTIONS)]
        requests.append(docs[0].__class__(text, len(tokenizer.encode(text)), 8))
    return requests


def prefix_phase(policy: str, rate: float, args) -> dict:
    # each prefill cache: half the prefixes (26 blocks of 16 tokens each) plus room for 2 in flight
    blocks = PREFIXES // 2 * (PREFIX_TOKENS // 16 + 1) + 2 * (PREFIX_TOKENS // 16 + 2)
    pools = {"prefill": {"num_instances": 2, "num_cpus_per_worker": 0.5, "engine": {"num_kv_blocks": blocks}},
             "decode": {"num_instances": 1, "num_cpus_per_worker": 0.5}}  # fmt: skip
    requests = prefix_workload(200, seed=1)
    with Deployment({"replan": False, "placement": policy, **pools}, base=args.config) as dep:
        calibration = _few(args, 16)
        run(dep.address, requests[:calibration], math.inf, num=calibration, concurrency=2)  # calibration
        out = run(dep.address, requests[calibration:], rate, duration_s=args.seconds)
    return _latency_summary(out)


def conditional_phase(local_tokens: int, rate: float, slo: SLO, args) -> dict:
    requests = workload(200, seed=2)
    settings = {"replan": False, "placement": "goodput", "local_prefill_max_tokens": local_tokens, "slo": slo.to_dict()}
    with Deployment(settings, base=args.config) as dep:
        run(dep.address, requests, math.inf, num=_few(args, 24), concurrency=2)  # calibration
        out = run(dep.address, requests, rate, duration_s=args.seconds, slo=slo)
    ok = [r for r in out["requests"] if r["success"] and r["output_len"] > 1]
    summary = _latency_summary(out)
    tpot_only = SLO(tpot_ms=slo.tpot_ms)
    summary["tpot_attainment"] = 100.0 * sum(met(tpot_only, 0.0, r["tpot"] * 1e3) for r in ok) / max(1, len(ok))
    summary["local"] = sum(r["server"].get("prefill_instance") == r["server"].get("decode_instance") for r in ok)
    return summary


def heterogeneous_workload(num: int, seed: int):
    tokenizer, _ = load_tokenizer(DEFAULT_MODEL)
    chat = make_workload(WorkloadConfig("chat", num, seed=seed, length_scale=0.5), tokenizer)
    code = make_workload(WorkloadConfig("code", num, seed=seed, length_scale=0.5), tokenizer)
    mixed = [r for pair in zip(chat, code) for r in pair][:num]
    return [r.__class__(r.prompt, r.prompt_len, min(r.output_len, MAX_OUTPUT)) for r in mixed]


HETEROGENEITY_TTFT_FACTOR = 2.0
HETEROGENEOUS_PREFILL = {"num_instances": 2, "num_cpus_per_worker": 0.5,
                         "instances": [{"threads_per_worker": 1}, {"threads_per_worker": 2}]}  # fmt: skip


def heterogeneity_phase(policy: str, rates: list[float], slo: SLO | None, args) -> dict:
    """`slo` None: set from this deployment's unloaded requests (sequential, after calibration):
    TTFT x HETEROGENEITY_TTFT_FACTOR at p90 (a long prompt on the slow instance is feasible when
    idle), TPOT x SLO_TPOT_FACTOR at p50."""
    requests = heterogeneous_workload(400, seed=3)
    runs = {}
    settings = {"replan": False, "placement": policy, "prefill": HETEROGENEOUS_PREFILL,
                "decode": {"num_instances": 1, "num_cpus_per_worker": 0.5}}  # fmt: skip
    with Deployment(settings, base=args.config) as dep:
        run(dep.address, requests, math.inf, num=_few(args, 32), concurrency=2)  # calibration
        if slo is None:
            unloaded = run(dep.address, requests, math.inf, num=_few(args, 24), concurrency=1)["summary"]
            slo = SLO(
                HETEROGENEITY_TTFT_FACTOR * unloaded["ttft_ms"]["p90"], SLO_TPOT_FACTOR * unloaded["tpot_ms"]["p50"]
            )
        for rate in rates:
            out = run(dep.address, requests, rate, duration_s=args.seconds, slo=slo)
            records = out["requests"]
            good = tally(records, slo).good
            by_instance = {}
            for r in records:
                if r["success"]:
                    name = r["server"].get("prefill_instance", "?")
                    by_instance[name] = by_instance.get(name, 0) + 1
            runs[f"{rate:.2f}"] = {"sent": len(records), "met_slo": good,
                                   "attainment": 100.0 * good / max(1, len(records)),
                                   "failures": out["summary"]["failures_by_code"], "by_prefill": by_instance}  # fmt: skip
    return {"slo": slo.to_dict(), "runs": runs, "goodput_rps": goodput_rate(runs)}


def goodput_rate(runs: dict, target: float = 90.0) -> float:
    """DistServe's goodput: the highest rate whose attainment is at least `target`, linear
    between the swept rates around the crossing (from rate 0, where all meet them, if even the
    lowest misses it)."""
    points = sorted((float(rate), r["attainment"]) for rate, r in runs.items())
    best = 0.0
    for (r0, a0), (r1, a1) in zip([(0.0, 100.0)] + points, points):
        if a1 >= target:
            best = r1
        elif a0 >= target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return best


def _latency_summary(out: dict) -> dict:
    ok = [r for r in out["requests"] if r["success"]]
    return {
        "sent": len(out["requests"]), "completed": len(ok),
        "ttft_ms_p50": float(np.median([r["ttft"] * 1e3 for r in ok])) if ok else math.nan,
        "tpot_ms_p50": float(np.median([r["tpot"] * 1e3 for r in ok if r["output_len"] > 1])) if ok else math.nan,
        "cached_tokens": sum(r["server"].get("cached_prompt_tokens", 0) for r in ok),
    }  # fmt: skip


def _p(records: list[dict], q: float) -> float:
    return float(np.percentile([r["e2el"] * 1e3 for r in records], q)) if records else math.nan


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="each open-loop run")
    parser.add_argument("--capacity-requests", type=int, default=48)
    parser.add_argument("--heterogeneity-rates", default="0.2,0.4,0.6,0.8",
                        help="the heterogeneity sweep, in units of the measured capacity")  # fmt: skip
    parser.add_argument("--phases", default="prediction,overload,prefix,conditional,heterogeneity",
                        help="a subset runs on the capacity and SLO of --out's earlier prediction phase")  # fmt: skip
    parser.add_argument("--out", default="loadtest/results/bench_router.json")
    parser.add_argument(
        "--profile", default=PROFILE, help="the 1-thread profile of this host the simulator replays with"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="2 requests in each calibration and unloaded run: a check that it runs, not figures",
    )
    add_config_argument(parser)
    args = parser.parse_args(argv)
    print(host_line(), flush=True)
    phases = set(args.phases.split(","))
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.exists() and "prediction" not in phases else {}
    requests = workload(200, seed=0)
    if "prediction" in phases:
        record["prediction"] = prediction_phase(requests, args)
        record["slo"] = {
            "ttft_ms": SLO_TTFT_FACTOR * record["prediction"]["base_ttft_ms"],
            "tpot_ms": SLO_TPOT_FACTOR * record["prediction"]["base_tpot_ms"],
        }
    prediction, slo = record["prediction"], SLO.from_dict(record["slo"])
    capacity = prediction["capacity_rps"]
    if "overload" in phases:
        base = prediction["base_ttft_ms"]
        record["overload"] = {
            p: overload_phase(requests, p, slo, capacity, base, args) for p in ("least_work", "goodput")
        }
    if "prefix" in phases:
        record["prefix"] = {p: prefix_phase(p, capacity / 2, args) for p in ("least_work", "goodput")}
    if "conditional" in phases:
        record["conditional"] = {str(n): conditional_phase(n, capacity / 2, slo, args) for n in (0, 256)}
    if "heterogeneity" in phases:
        rates = [float(f) * capacity for f in args.heterogeneity_rates.split(",")]
        least = heterogeneity_phase("least_work", rates, None, args)  # sets the SLO both are judged by
        record["heterogeneity"] = {
            "least_work": least,
            "goodput": heterogeneity_phase("goodput", rates, SLO.from_dict(least["slo"]), args),
        }
    for earlier in ("host", "args"):  # an earlier phase's: this run's go in
        record.pop(earlier, None)
    write_results(out, record, args)
    print(
        json.dumps({k: v for k, v in record.items() if k not in ("prediction", "host", "args")}, indent=1), flush=True
    )
    print_figures(record)
    return 0


def print_figures(record: dict) -> None:
    prediction = record["prediction"]
    print(f"ttft mape: {prediction['ttft_mape']:.1f}")
    print(f"tpot mape: {prediction['tpot_mape']:.1f}")
    if "overload" in record:
        good, least = record["overload"]["goodput"], record["overload"]["least_work"]
        admitted = sum(good[k]["admitted"] for k in good)
        attainment = 100.0 * sum(good[k]["met_slo"] for k in good) / admitted if admitted else math.nan
        for k in ("2x", "3x"):
            ratio = good[k]["goodput_rps"] / least[k]["goodput_rps"] if least[k]["goodput_rps"] else math.inf
            print(f"overload {k} goodput ratio: {ratio:.2f}")
        print(f"admitted attainment: {attainment:.1f}")
        print(f"refusal ms p99: {max(good['2x']['refusal_ms_p99'], good['3x']['refusal_ms_p99']):.1f}")
        errors = {}
        for policy, runs in record["overload"].items():
            for k, r in runs.items():
                if "simulated" in r:
                    sim = r["simulated"]
                    measured, simulated = 100.0 * r["met_slo"] / r["sent"], 100.0 * sim["met_slo"] / sim["sent"]
                    errors.setdefault(policy, []).append(abs(simulated - measured))
                    print(f"  {policy} {k}: attainment measured {measured:.1f}%, simulated {simulated:.1f}% "
                          f"(refused {r['refused']} / {sim['refused']} of {r['sent']})")  # fmt: skip
        if errors:  # the figure is the goodput policy's (the router's); least work's is context
            print(f"simulated attainment error: {max(errors.get('goodput', [math.nan])):.1f} "
                  f"(least work: {max(errors.get('least_work', [math.nan])):.1f})")  # fmt: skip
    if "heterogeneity" in record:
        good, least = (record["heterogeneity"][p]["goodput_rps"] for p in ("goodput", "least_work"))
        print(
            f"heterogeneity goodput ratio: {good / least if least else math.inf:.2f} ({good:.2f} / {least:.2f} req/s)"
        )
    if "prefix" in record:
        prefix = record["prefix"]
        print(f"prefix ttft ratio: {prefix['goodput']['ttft_ms_p50'] / prefix['least_work']['ttft_ms_p50']:.2f}")
    if "conditional" in record:
        local, always = record["conditional"]["256"], record["conditional"]["0"]
        print(f"conditional ttft ratio: {local['ttft_ms_p50'] / always['ttft_ms_p50']:.2f}")
        print(f"conditional tpot attainment: {local['tpot_attainment']:.1f} (always: {always['tpot_attainment']:.1f})")


if __name__ == "__main__":
    sys.exit(main())
