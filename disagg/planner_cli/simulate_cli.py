"""`disagg simulate | plan`: simulate a deployment, search for one (`disagg profile`, which runs
an engine, lives in disagg/profiling/)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def add_commands(sub) -> None:
    _add_simulate(sub)
    _add_plan(sub)


# ---- simulate ----------------------------------------------------------------------------------
def _add_simulate(sub) -> None:
    p = sub.add_parser(
        "simulate", help="simulate a serving config on a workload or a replayed trace (same metrics as `disagg bench`)"
    )
    p.add_argument("--config", help="serving config YAML (with --trace: overrides the trace's own)")
    p.add_argument("--profile", required=True, help="profile JSON: `disagg profile`, roofline, or DistServe's")
    p.add_argument("--prefill-profile", help="another profile for the prefill pool (mixed hardware)")
    p.add_argument("--model", help="which model of a multi-model profile (DistServe's); default: the trace's")
    p.add_argument("--trace", help="replay a trace (../shared/data/distserve/*.json format)")
    p.add_argument("--workload", default="chat", help="chat | code | summarization | fixed (as `disagg bench`)")
    p.add_argument("--rate", type=float, default=1.0, help="requests/s")
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, help="context the workload's lengths scale to (default: the model's)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--slo", help="e.g. ttft_ms=200,tpot_ms=100 (default: the config's or the trace's)")
    p.add_argument("--router-overhead-ms", type=float, default=0.0, help="client + router time before the prefill")
    p.add_argument("--from-hardware", action="store_true", help="KV capacity from the hardware, not the config")
    p.add_argument("--json", help="write {requests: [{ttft_ms, tpot_ms}], slo_attainment, summary} here")
    p.add_argument("--result-file", "-o", help="write a `disagg bench`-format result here (for `disagg report`)")
    p.add_argument("--label", help="name of the run in reports")
    p.add_argument(
        "--replan",
        action="store_true",
        help="disaggregated: with the re-planner switching instances between the pools, against every static split",
    )
    p.set_defaults(func=simulate_command)


def simulate_command(args) -> int:
    from disagg.bench.metrics import format_summary
    from disagg.planner_cli.bench_records import bench_result
    from disagg.slo import parse_slo

    deployment, requests, slo, rate = _simulation(args)
    slo = parse_slo(args.slo) if args.slo else slo
    if args.replan:
        return _replan_command(deployment, requests)
    records = deployment.simulator().run(requests)
    label = args.label or f"simulated {deployment.config.mode}"
    result = bench_result(label, requests, records, rate, slo, {"profile": args.profile})
    print(format_summary(result["summary"], title="Simulated Serving Result"))
    if args.result_file:
        _write(args.result_file, result)
    if args.json:
        rows = [{"ttft_ms": _ms(r.ttft_s), "tpot_ms": _ms(r.tpot_s)} for r in records]
        _write(args.json, {"requests": rows, "slo_attainment": result["summary"]["slo_attainment_pct"], **result})
    return 0


def _replan_command(deployment, requests) -> int:
    from disagg.planner.replan_sim import replan_report

    if deployment.config.mode != "disaggregated" or deployment.system is not None:
        raise ValueError(
            "simulate --replan: give a disaggregated --config (the re-planner moves instances between its pools)"
        )
    report = replan_report(deployment.config, deployment.profiles, requests)
    for split, value in report["static_goodput"].items():
        print(f"static {split} goodput: {value:.3f}")
    print(f"best static goodput: {report['best_static_goodput']:.3f}")
    print(f"replan goodput: {report['replan_goodput']:.3f}")
    print(f"replan goodput ratio: {report['replan_goodput_ratio']:.3f}")
    for decided, instance, role, done in report["switches"]:
        ready = f"serving at {done:.1f}s" if done is not None else "not done by the end"
        print(f"switch at {decided:.1f}s: {instance} -> {role} ({ready})")
    return 0


def _simulation(args):
    """(deployment, requests, slo, rate) from a trace or from a config + workload."""
    from disagg.config import ServingConfig
    from disagg.placement.profile import load_profile
    from disagg.planner.deployment import Deployment, trace_config
    from disagg.planner.traced_systems import system_of
    from disagg.planner.workload import load_trace

    if args.trace:
        trace = load_trace(args.trace)
        model = args.model or trace.model
        config = ServingConfig.from_yaml(args.config) if args.config else trace_config(trace.config, model)
        profiles = _profiles(args, config, model)
        deployment = Deployment(config, profiles, from_hardware=not args.config or args.from_hardware)
        deployment.system = None if args.config else system_of(trace.config)  # replayed as it ran
        deployment.router_overhead_ms = args.router_overhead_ms
        rate = len(trace.requests) / trace.duration_s if trace.duration_s else math.inf
        return deployment, trace.requests, trace.slo, rate
    if not args.config:
        raise ValueError("simulate: give --config (with a workload) or --trace")
    config = ServingConfig.from_yaml(args.config)
    profile = load_profile(args.profile, model=args.model)
    profiles = _profiles(args, config, profile.model)
    deployment = Deployment(config, profiles, from_hardware=args.from_hardware)
    deployment.router_overhead_ms = args.router_overhead_ms
    return deployment, synthetic_requests(args, profile.model), config.slo, args.rate


def _profiles(args, config, model: str) -> dict:
    from disagg.placement.profile import load_profile

    main = load_profile(args.profile, model=model)
    profiles = {role: main for role, _ in config.pools()}
    if args.prefill_profile and "prefill" in profiles:
        profiles["prefill"] = load_profile(args.prefill_profile, model=model)
    return profiles


def synthetic_requests(args, model: str):
    """The lengths and arrivals `disagg bench` would send with the same workload, rate and seed."""
    from disagg.bench.open_loop import LoadConfig, arrival_times
    from disagg.bench.workloads import WorkloadConfig, sample_lengths
    from disagg.planner.models import model_spec
    from disagg.planner.workload import SimRequest

    context = args.max_model_len or _context_of(model, model_spec)
    workload = WorkloadConfig(
        args.workload, args.num_requests, args.seed, context, args.length_scale, args.input_len, args.output_len
    )
    prompts, outputs = sample_lengths(workload)
    times = arrival_times(LoadConfig(args.rate, args.burstiness, args.num_requests, seed=args.seed))
    return [SimRequest(i, float(t), int(p), int(o)) for i, (t, p, o) in enumerate(zip(times, prompts, outputs))]


def _context_of(model: str, model_spec) -> int:
    try:
        return model_spec(model).max_position_embeddings
    except ValueError:
        return 8192


def _ms(seconds: float) -> float | None:
    return round(seconds * 1e3, 3) if math.isfinite(seconds) else None


def _write(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")


# ---- plan --------------------------------------------------------------------------------------
def _add_plan(sub) -> None:
    from disagg.planner_cli import plan_cli

    p = sub.add_parser("plan", help="search TP/PP, instances and modes for the most goodput per device")
    plan_cli.add_arguments(p, argparse)
    p.set_defaults(func=plan_cli.main)
