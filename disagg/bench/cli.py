"""`disagg bench | report | experiment` (registered by disagg/cli.py)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from disagg.bench.workloads import WORKLOADS
from disagg.slo import parse_slo


def add_commands(sub) -> None:
    _add_bench(sub)
    _add_report(sub)
    _add_experiment(sub)


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="chat",
        help="chat: ShareGPT-shaped; code: long prompt, short output; summarization: long prompt, medium output; fixed: --input-len/--output-len",
    )
    g.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrivals")
    g.add_argument("--model", help="whose tokenizer sizes the prompts (default: the default model; use the server's)")
    g.add_argument("--max-model-len", type=int, help="context to scale lengths to (default: the model's)")
    g.add_argument(
        "--length-scale", type=float, default=1.0, help="multiply every prompt and output length (e.g. 0.25 on a CPU)"
    )
    g.add_argument("--input-len", type=int, default=256, help="fixed workload: prompt tokens")
    g.add_argument("--output-len", type=int, default=64, help="fixed workload: output tokens")


def _workload(args, num_requests: int) -> tuple[list, dict]:
    from disagg.bench.workloads import (
        WorkloadConfig,
        describe,
        load_tokenizer,
        make_workload,
    )

    tokenizer, context = load_tokenizer(args.model)
    config = WorkloadConfig(
        args.workload,
        num_requests,
        args.seed,
        args.max_model_len or context,
        args.length_scale,
        args.input_len,
        args.output_len,
    )
    requests = make_workload(config, tokenizer)
    return requests, describe(config, requests)


# ---- bench -------------------------------------------------------------------------------------
def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench", help="open-loop benchmark of a running server (vLLM bench serve metrics, SLO attainment, goodput)"
    )
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of a `disagg serve`")
    p.add_argument(
        "--request-rate", "--rate", type=float, default=math.inf, help="requests/s (default inf: all at once)"
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier"
    )
    p.add_argument("--num-requests", "--num-prompts", type=int, help="requests to send (default 100)")
    p.add_argument("--duration", type=float, help="seconds of arrivals instead of a count")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight (due requests wait for a slot)")
    p.add_argument("--slo", help="e.g. ttft_ms=500,tpot_ms=100: attainment and goodput count the requests that met it")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline (s)")
    p.add_argument("--tls-ca", help="PEM CA file: connect with TLS (the API key comes from $DISAGG_API_KEY)")
    p.add_argument("--label", help="name of this run in reports (default: the workload)")
    p.add_argument("--result-file", "-o", help="JSON to write (default: disagg-bench-<workload>-<rate>-<time>.json)")
    _add_workload_args(p)
    p.set_defaults(func=bench_command)


def bench_command(args) -> int:
    from disagg.bench.metrics import format_summary
    from disagg.bench.open_loop import LoadConfig, arrival_times, run_benchmark

    num_requests = args.num_requests if args.num_requests is not None or args.duration is not None else 100
    load = LoadConfig(
        args.request_rate,
        args.burstiness,
        num_requests,
        args.duration,
        args.max_concurrency,
        args.seed,
        args.timeout,
        args.temperature,
    )
    slo = parse_slo(args.slo)
    requests, workload = _workload(args, len(arrival_times(load)))
    print(
        f"disagg bench: {workload['num_requests']} {args.workload} requests at {args.request_rate:g} req/s (burstiness {args.burstiness:g}) to {args.server}",
        flush=True,
    )
    result = {
        "label": args.label or args.workload,
        "workload": workload,
        **run_benchmark(args.server, requests, load, slo, tls_ca=args.tls_ca),
    }
    path = (
        args.result_file or f"disagg-bench-{args.workload}-{args.request_rate:g}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")
    print(format_summary(result["summary"]))
    print(f"result: {path}")
    return 0 if result["summary"]["completed"] else 1


# ---- report ------------------------------------------------------------------------------------
def _add_report(sub) -> None:
    p = sub.add_parser(
        "report", help="table and plots (TTFT/TPOT CDFs, attainment and goodput vs rate) of benchmark runs"
    )
    p.add_argument(
        "results", nargs="+", help="`disagg bench` JSON files or folders of them; Locust per-request rows (.csv)"
    )
    p.add_argument("--out-dir", default="bench-report")
    p.add_argument("--slo", help="recompute attainment and goodput with this SLO (default: each run's own)")
    p.set_defaults(func=report_command)


def report_command(args) -> int:
    from disagg.bench.report import load_runs, write_report

    paths = write_report(load_runs(args.results), args.out_dir, parse_slo(args.slo) if args.slo else None)
    print(Path(paths["table"]).read_text())
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


# ---- experiment --------------------------------------------------------------------------------
def _add_experiment(sub) -> None:
    from disagg.bench.experiment import MODE_CONFIGS

    p = sub.add_parser(
        "experiment",
        help="one workload across rates: disaggregated vs colocated (chunked) vs colocated (prefill-first)",
    )
    p.add_argument("--rates", default="0.5,1,2", help="comma-separated request rates (req/s)")
    p.add_argument(
        "--loads",
        help="instead of --rates: comma-separated fractions of the first mode's capacity, measured first (e.g. 0.5,0.8,1)",
    )
    p.add_argument("--num-requests", type=int, default=40, help="requests per rate")
    p.add_argument("--modes", default=",".join(MODE_CONFIGS), help=f"comma-separated, from {', '.join(MODE_CONFIGS)}")
    p.add_argument("--config-dir", default="deploy/configs", help="where the modes' serving configs are")
    p.add_argument(
        "--slo", help="e.g. ttft_ms=2000,tpot_ms=150 (default: --slo-factor x the first mode's unloaded medians)"
    )
    p.add_argument("--slo-factor", type=float, default=4.0)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int)
    p.add_argument(
        "--one-server-at-a-time",
        action="store_true",
        help="serve one mode at a time (less memory) instead of all at once, taking turns at each rate",
    )
    p.add_argument("--out-dir", default="experiment-results")
    _add_workload_args(p)
    p.set_defaults(func=experiment_command)


def experiment_command(args) -> int:
    from disagg.bench.experiment import ExperimentConfig, run_experiment, workload_size

    levels = _numbers("loads", args.loads) if args.loads else _numbers("rates", args.rates)
    exp = ExperimentConfig(
        () if args.loads else levels,
        args.num_requests,
        args.out_dir,
        tuple(m.strip() for m in args.modes.split(",")),
        args.config_dir,
        parse_slo(args.slo) if args.slo else None,
        args.slo_factor,
        burstiness=args.burstiness,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        interleave=not args.one_server_at_a_time,
        loads=levels if args.loads else (),
    )
    requests, workload = _workload(args, workload_size(exp))
    started = time.monotonic()
    paths = run_experiment(exp, requests, workload, log=lambda line: print(line, flush=True))
    print(Path(paths["table"]).read_text())
    for name, path in paths.items():
        print(f"{name}: {path}")
    print(f"experiment took {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0


def _numbers(name: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(r) for r in text.split(","))
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a comma-separated list of numbers") from None
