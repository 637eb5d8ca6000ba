"""Scheduling by predicted output length (issue 39): FCFS against LTR on the same requests, and
priorities under overload, each against a real `disagg serve` deployment.

    .venv/bin/python -m loadtest.router.scheduling [--load 1.2] [--json FILE] [--smoke]

The workload: the held-out chat prompts of `loadtest/data/ranking_smollm2.jsonl` (answers of 8
to 256 tokens from the default model: one-word answers to essays), greedy with EOS, max_tokens
256, arriving as a Poisson stream faster than the decode side finishes them, so that its queue
builds (the decode engine runs at most `--max-num-seqs` requests at once, as vLLM's max_num_seqs).
The rate is `--load` times the capacity of that deployment on that workload, measured first on a
deployment of its own (disagg.bench.capacity: the training prompts, which the measured runs do
not repeat), so that the queue builds alike on a fast host and a slow one; both are printed.
Three deployments in turn, each with the machine otherwise idle:

- fcfs, the router expecting max_tokens (today's default);
- fcfs, the router expecting the ranker's lengths (`output_length: ranker`);
- ltr (`scheduling_order: ltr` in every engine), the router expecting the ranker's lengths.

Printed: `kendall tau` (the ranker's order against the lengths written), `mean latency ratio`,
`p99 latency ratio` and `ttft p50 ratio` (LTR / FCFS end to end, both with the ranker's router:
only the order differs), `tpot mape` of the router's predictions with max_tokens and with
predicted lengths (against the server's decode time per token). Then `--priorities`' run: the
same prompts at twice the rate, a third each critical, standard and sheddable, with an SLO, and
each class's attainment (disagg.slo.met; a refusal misses).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from disagg.bench.capacity import Capacity, add_load_argument, measure_capacity
from disagg.bench.launcher import Deployment, add_config_argument
from disagg.bench.load_client import GrpcApi, LoadRequest, open_loop, run_loop
from disagg.bench.metrics import RequestRecord
from disagg.bench.results import host_line, write_results
from disagg.bench.slo_tally import SloTally
from disagg.client import generate_request
from disagg.ranking.evaluation import kendall_tau_b
from disagg.ranking.ranker import DEFAULT_RANKER_FILE, LengthRanker
from disagg.slo import SLO

DATA = Path(__file__).resolve().parents[1] / "data" / "ranking_smollm2.jsonl"
MAX_TOKENS = 256
CLASSES = ("critical", "standard", "sheddable")


@dataclass
class Run:
    name: str
    records: list[RequestRecord] = field(default_factory=list)
    priorities: list[str] = field(default_factory=list)  # of each record
    duration_s: float = 0.0

    @property
    def done(self) -> list[RequestRecord]:
        return [r for r in self.records if r.success]


def prompts_of(split: str) -> list[list[int]]:
    """The prompts of the "train" split, or of the held-out ones (any other)."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return [r["prompt_token_ids"] for r in rows if (r["split"] == "train") == (split == "train")]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


def load_request(index: int, prompt: list[int], priority: str = "standard", slo: SLO | None = None) -> LoadRequest:
    message = generate_request(
        prompt_token_ids=prompt, request_id=f"sched-{index}", priority=priority, slo=slo,
        temperature=0.0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    return LoadRequest(message, len(prompt))


def capacity(base: str | None, settings: dict, prompts: list[list[int]], streams: int) -> Capacity:
    """The deployment's completion rate at saturation on these prompts (a deployment of its own:
    the measured ones fit their models from the measured traffic alone)."""
    requests = [LoadRequest(generate_request(prompt_token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS), len(p))
                for p in prompts]  # fmt: skip
    with Deployment(settings, base=base, name="sched-capacity") as deployment:
        return run_loop(GrpcApi(deployment.address), measure_capacity, requests, streams)


def serve_and_drive(name: str, base: str | None, settings: dict, requests, times, priorities) -> Run:
    with Deployment(settings, base=base, name="sched") as deployment:
        sent = run_loop(GrpcApi(deployment.address), open_loop, requests, times)
    run = Run(name, sent.records, list(priorities), sent.duration_s)
    errors = Counter(f"{r.error_code}: {r.error[:80]}" for r in run.records if not r.success)
    if errors:
        print(f"  {name}: errors {dict(errors)}", flush=True)
    done = run.done
    print(
        f"  {name}: {len(done)}/{len(run.records)} answered in {run.duration_s:.0f} s, "
        f"mean e2e {statistics.fmean(r.e2el for r in done):.2f} s, p99 {percentile([r.e2el for r in done], 99):.2f} s, "
        f"ttft p50 {percentile([r.ttft for r in done], 50):.2f} s",
        flush=True,
    )
    return run


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    rank = (len(values) - 1) * q / 100
    low = math.floor(rank)
    return values[low] + (values[min(low + 1, len(values) - 1)] - values[low]) * (rank - low)


def server_tpot_s(record: RequestRecord) -> float:
    """The server's decode time per token after the first: what the router's TPOT predicts."""
    return record.server.get("decode_s", 0.0) / (record.output_len - 1) if record.output_len > 1 else math.nan


def tpot_mape(run: Run) -> float:
    """Mean |predicted - measured| / measured over the requests with a prediction and 2+ tokens."""
    errors = []
    for r in run.done:
        predicted, measured = r.server.get("predicted_tpot_s", 0.0), server_tpot_s(r)
        if predicted > 0 and r.output_len > 1 and measured > 0:
            errors.append(abs(predicted - measured) / measured)
    return statistics.fmean(errors) if errors else math.nan


def ratio(ltr: Run, fcfs: Run, measure) -> float:
    return measure(ltr.done) / measure(fcfs.done)


def attainment(run: Run, slo: SLO) -> dict[str, float]:
    """Per class: the share of its requests that met the SLO (a refusal misses)."""
    tallies = {cls: SloTally(slo) for cls in CLASSES}
    for record, priority in zip(run.records, run.priorities):
        tallies[priority].add(record)
    return {cls: t.attainment_pct / 100 if t.requests else math.nan for cls, t in tallies.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_load_argument(parser, 1.2, "the FCFS/LTR runs' rate (the priorities run's is twice it)")
    parser.add_argument("--rate", type=float, help="requests/s instead: no capacity measured (an earlier run's rate)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the decode engine's batch at most")
    parser.add_argument("--num-requests", type=int, default=120)
    parser.add_argument(
        "--capacity-requests", type=int, default=24, help="training prompts the capacity is measured on"
    )
    parser.add_argument("--ttft-ms", type=float, default=4000.0, help="the priorities run's SLO")
    parser.add_argument("--tpot-ms", type=float, default=150.0, help="the priorities run's SLO")
    parser.add_argument("--skip-priorities", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: it runs, no figures")
    parser.add_argument("--json", help="write every request's outcome here")
    add_config_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:  # arrivals within seconds however little a few requests measure the capacity at
        args.num_requests, args.capacity_requests, args.load = 6, 4, 8.0
    print(host_line(), flush=True)

    pool = prompts_of("heldout")
    rng = random.Random(0)
    prompts = [pool[i % len(pool)] for i in rng.sample(range(len(pool)), len(pool))][: args.num_requests]
    common = {
        "calibration_s": 0,  # the router's models fit online, from this traffic
        "slo_admission": "best_effort",  # the order is what is measured here, not admission
        "max_inflight_requests": 4 * len(prompts),  # a queue builds rather than refusals
        "admission_timeout_s": 600,
        "kv_timeout_s": 600,  # how long a prefilled prompt may wait for room on the decode side
        "replan": False,
        "decode": {"engine": {"max_num_seqs": args.max_num_seqs}},
    }
    measured = None
    if args.rate is None:
        streams = 2 * args.max_num_seqs  # enough that the decode side's batch stays full
        measured = capacity(args.config, common, prompts_of("train")[: args.capacity_requests], streams)
        args.rate = measured.rate(args.load)
        print(measured.describe(args.load), flush=True)
    times = arrivals(len(prompts), args.rate, seed=1)
    standard = [load_request(i, p) for i, p in enumerate(prompts)]
    ltr_engines = {"engine": {"scheduling_order": "ltr"}}
    print(f"{len(prompts)} held-out prompts at {args.rate:.3f}/s, decode batch <= {args.max_num_seqs}", flush=True)
    level = ["standard"] * len(prompts)
    fcfs_max = serve_and_drive("fcfs, router max_tokens", args.config, common, standard, times, level)
    ranker_router = {**common, "output_length": "ranker"}
    fcfs = serve_and_drive("fcfs, router ranker", args.config, ranker_router, standard, times, level)
    ltr = serve_and_drive("ltr, router ranker", args.config, {**ranker_router, **ltr_engines}, standard, times, level)

    ranker = LengthRanker.load(DEFAULT_RANKER_FILE)
    written = {r.index: r.output_len for r in fcfs.done}
    tau = kendall_tau_b([ranker.score(prompts[i]) for i in written], list(written.values()))
    figures = {
        "kendall tau": tau,
        "mean latency ratio": ratio(ltr, fcfs, lambda rs: statistics.fmean(r.e2el for r in rs)),
        "p99 latency ratio": ratio(ltr, fcfs, lambda rs: percentile([r.e2el for r in rs], 99)),
        "ttft p50 ratio": ratio(ltr, fcfs, lambda rs: percentile([r.ttft for r in rs], 50)),
        "tpot mape, router max_tokens": tpot_mape(fcfs_max),
        "tpot mape, router ranker": tpot_mape(fcfs),
    }
    runs = [fcfs_max, fcfs, ltr]
    if not args.skip_priorities:
        slo = SLO(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms)
        classes = [CLASSES[i % 3] for i in range(len(prompts))]
        overload = {**common, "slo_admission": "reject"}
        rushed = [t / 2 for t in times]  # twice the rate
        sent = [load_request(i, p, cls, slo) for i, (p, cls) in enumerate(zip(prompts, classes))]
        prio = serve_and_drive("priorities, fcfs, 2x rate", args.config, overload, sent, rushed, classes)
        runs.append(prio)
        for cls, share in attainment(prio, slo).items():
            figures[f"attainment {cls}"] = share
    for name, value in figures.items():
        print(f"{name}: {value:.3f}")
    if args.json:
        rows = [{"name": r.name, "duration_s": r.duration_s, "outcomes": [outcome(x, p) for x, p in zip(r.records, r.priorities)]}
                for r in runs]  # fmt: skip
        rates = {
            "rate": args.rate,
            "load": args.load if measured else None,
            "capacity": measured and measured.to_dict(),
        }
        write_results(args.json, {"figures": figures, **rates, "runs": rows}, args)
    return 0


def outcome(record: RequestRecord, priority: str) -> dict:
    """A request as the client saw it, with what the router predicted for it."""
    return {
        "index": record.index, "priority": priority, "sent_s": record.sent_at,
        "ttft_s": record.ttft if record.success else math.nan, "e2e_s": record.e2el, "tokens": record.output_len,
        "predicted_tpot_s": record.server.get("predicted_tpot_s", 0.0), "decode_s": record.server.get("decode_s", 0.0),
        "error": "" if record.success else f"{record.error_code}: {record.error[:80]}",
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
