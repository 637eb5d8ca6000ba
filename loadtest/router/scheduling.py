"""Scheduling by predicted output length (issue 39): FCFS against LTR on the same requests, and
priorities under overload, each against a real `disagg serve` deployment.

    PYTHONPATH=. .venv/bin/python loadtest/bench_scheduling.py [--json FILE] [--smoke]

The workload: the held-out chat prompts of `loadtest/data/ranking_smollm2.jsonl` (answers of 8
to 256 tokens from the default model: one-word answers to essays), greedy with EOS, max_tokens
256, arriving as a Poisson stream faster than the decode side finishes them, so that its queue
builds (the decode engine runs at most `--max-num-seqs` requests at once, as vLLM's max_num_seqs).
Three deployments in turn, each with the machine otherwise idle:

- fcfs, the router expecting max_tokens (today's default);
- fcfs, the router expecting the ranker's lengths (`output_length: ranker`);
- ltr (`scheduling_order: ltr` in every engine), the router expecting the ranker's lengths.

Printed: `kendall tau` (the ranker's order against the lengths written), `mean latency ratio`,
`p99 latency ratio` and `ttft p50 ratio` (LTR / FCFS end to end, both with the ranker's router:
only the order differs), `tpot mape` of the router's predictions with max_tokens and with
predicted lengths. Then `--priorities`' run: the same prompts at twice the rate, a third each
critical, standard and sheddable, with an SLO, and each class's attainment.
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
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).parent))
from served import Deployment, add_config_argument  # noqa: E402

from disagg.client import generate_request  # noqa: E402
from disagg.ranking.evaluation import kendall_tau_b  # noqa: E402
from disagg.ranking.ranker import DEFAULT_RANKER_FILE, LengthRanker  # noqa: E402
from disagg.v1 import serving_pb2  # noqa: E402
from disagg.v1 import serving_pb2_grpc  # noqa: E402

DATA = Path(__file__).parent / "data" / "ranking_smollm2.jsonl"
MAX_TOKENS = 256
CLASSES = ("critical", "standard", "sheddable")


@dataclass
class Outcome:
    """One request as the client saw it, with what the router predicted for it."""

    index: int
    priority: str = "standard"
    sent_s: float = 0.0
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    tokens: int = 0
    predicted_tpot_s: float = 0.0
    decode_s: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot_s(self) -> float:
        return self.decode_s / (self.tokens - 1) if self.tokens > 1 else math.nan


@dataclass
class Run:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    duration_s: float = 0.0


def heldout_prompts() -> list[list[int]]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return [r["prompt_token_ids"] for r in rows if r["split"] != "train"]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


async def send(stub, index: int, prompt: list[int], priority: str, slo, started: float) -> Outcome:
    outcome = Outcome(index, priority)
    request = generate_request(
        prompt_token_ids=prompt, request_id=f"sched-{index}", priority=priority, slo=slo,
        temperature=0.0, max_tokens=MAX_TOKENS,
    )  # fmt: skip
    sent = time.perf_counter()
    outcome.sent_s = sent - started
    try:
        async for msg in stub.Generate(request, timeout=600):
            if msg.token_ids and math.isnan(outcome.ttft_s):
                outcome.ttft_s = time.perf_counter() - sent
            outcome.tokens += len(msg.token_ids)
            if msg.finished:
                outcome.predicted_tpot_s = msg.timings.predicted_tpot_s
                outcome.decode_s = msg.timings.decode_s
    except grpc.aio.AioRpcError as exc:
        outcome.error = f"{exc.code().name}: {(exc.details() or '')[:80]}"
    outcome.e2e_s = time.perf_counter() - sent
    return outcome


async def drive(address: str, prompts: list[list[int]], times: list[float], priorities: list[str], slo) -> Run:
    run = Run("")
    async with grpc.aio.insecure_channel(address) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=30)
        stub = serving_pb2_grpc.ServingStub(channel)
        started = time.perf_counter()
        tasks = []
        for i, (prompt, due, priority) in enumerate(zip(prompts, times, priorities)):
            await asyncio.sleep(max(0.0, started + due - time.perf_counter()))
            tasks.append(asyncio.create_task(send(stub, i, prompt, priority, slo, started)))
        run.outcomes = list(await asyncio.gather(*tasks))
        run.duration_s = time.perf_counter() - started
    return run


def serve_and_drive(name: str, base: str | None, overrides: dict, prompts, times, priorities, slo=None) -> Run:
    with tempfile.TemporaryDirectory(prefix="sched-") as workdir:
        deployment = Deployment(Path(workdir), base, **overrides)
        try:
            run = asyncio.run(drive(deployment.address, prompts, times, priorities, slo))
        finally:
            deployment.stop()
    run.name = name
    done = [o for o in run.outcomes if o.ok]
    errors = Counter(o.error for o in run.outcomes if not o.ok)
    if errors:
        print(f"  {name}: errors {dict(errors)}", flush=True)
    print(
        f"  {name}: {len(done)}/{len(run.outcomes)} answered in {run.duration_s:.0f} s, "
        f"mean e2e {statistics.fmean(o.e2e_s for o in done):.2f} s, p99 {percentile([o.e2e_s for o in done], 99):.2f} s, "
        f"ttft p50 {percentile([o.ttft_s for o in done], 50):.2f} s",
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


def tpot_mape(run: Run) -> float:
    """Mean |predicted - measured| / measured over the requests with a prediction and 2+ tokens."""
    errors = [
        abs(o.predicted_tpot_s - o.tpot_s) / o.tpot_s
        for o in run.outcomes
        if o.ok and o.predicted_tpot_s > 0 and o.tokens > 1 and o.tpot_s > 0
    ]
    return statistics.fmean(errors) if errors else math.nan


def ratio(ltr: Run, fcfs: Run, measure) -> float:
    return measure([o for o in ltr.outcomes if o.ok]) / measure([o for o in fcfs.outcomes if o.ok])


def attainment(run: Run, slo) -> dict[str, float]:
    """Per class: the share of its requests answered within both targets (a refusal misses)."""
    out = {}
    for cls in CLASSES:
        mine = [o for o in run.outcomes if o.priority == cls]
        met = [
            o
            for o in mine
            if o.ok and o.ttft_s * 1e3 <= slo.ttft_ms and (o.tokens < 2 or o.tpot_s * 1e3 <= slo.tpot_ms)
        ]
        out[cls] = len(met) / len(mine) if mine else math.nan
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=1.5, help="requests/s of the FCFS/LTR runs")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the decode engine's batch at most")
    parser.add_argument("--num-requests", type=int, default=120)
    parser.add_argument("--ttft-ms", type=float, default=4000.0, help="the priorities run's SLO")
    parser.add_argument("--tpot-ms", type=float, default=150.0, help="the priorities run's SLO")
    parser.add_argument("--skip-priorities", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: it runs, no figures")
    parser.add_argument("--json", help="write every request's outcome here")
    add_config_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.num_requests, args.rate = 6, 4.0

    pool = heldout_prompts()
    rng = random.Random(0)
    prompts = [pool[i % len(pool)] for i in rng.sample(range(len(pool)), len(pool))][: args.num_requests]
    times = arrivals(len(prompts), args.rate, seed=1)
    standard = ["standard"] * len(prompts)
    common = {
        "calibration_s": 0,  # the router's models fit online, from this traffic
        "slo_admission": "best_effort",  # the order is what is measured here, not admission
        "max_inflight_requests": 4 * len(prompts),  # a queue builds rather than refusals
        "admission_timeout_s": 600,
        "kv_timeout_s": 600,  # how long a prefilled prompt may wait for room on the decode side
        "replan": False,
        "decode": {"engine": {"max_num_seqs": args.max_num_seqs}},
    }
    ltr_engines = {"engine": {"scheduling_order": "ltr"}}
    print(f"{len(prompts)} held-out prompts at {args.rate}/s, decode batch <= {args.max_num_seqs}", flush=True)
    fcfs_max = serve_and_drive("fcfs, router max_tokens", args.config, common, prompts, times, standard)
    fcfs = serve_and_drive(
        "fcfs, router ranker", args.config, {**common, "output_length": "ranker"}, prompts, times, standard
    )
    ltr = serve_and_drive(
        "ltr, router ranker",
        args.config,
        {**common, **ltr_engines, "output_length": "ranker"},
        prompts,
        times,
        standard,
    )

    ranker = LengthRanker.load(DEFAULT_RANKER_FILE)
    written = {o.index: o.tokens for o in fcfs.outcomes if o.ok}
    tau = kendall_tau_b([ranker.score(prompts[i]) for i in written], list(written.values()))
    figures = {
        "kendall tau": tau,
        "mean latency ratio": ratio(ltr, fcfs, lambda os: statistics.fmean(o.e2e_s for o in os)),
        "p99 latency ratio": ratio(ltr, fcfs, lambda os: percentile([o.e2e_s for o in os], 99)),
        "ttft p50 ratio": ratio(ltr, fcfs, lambda os: percentile([o.ttft_s for o in os], 50)),
        "tpot mape, router max_tokens": tpot_mape(fcfs_max),
        "tpot mape, router ranker": tpot_mape(fcfs),
    }
    runs = [fcfs_max, fcfs, ltr]
    if not args.skip_priorities:
        slo = serving_pb2.Slo(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms)
        classes = [CLASSES[i % 3] for i in range(len(prompts))]
        overload = {**common, "slo_admission": "reject"}
        rushed = [t / 2 for t in times]  # twice the rate
        prio = serve_and_drive("priorities, fcfs, 2x rate", args.config, overload, prompts, rushed, classes, slo)
        runs.append(prio)
        for cls, share in attainment(prio, slo).items():
            figures[f"attainment {cls}"] = share
    for name, value in figures.items():
        print(f"{name}: {value:.3f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        data = {"figures": figures, "args": vars(args), "runs": [{"name": r.name, "duration_s": r.duration_s,
                "outcomes": [asdict(o) for o in r.outcomes]} for r in runs]}  # fmt: skip
        Path(args.json).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
