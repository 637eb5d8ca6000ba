"""Placement at scale (issue 40): what a goodput placement decision costs at 8x8, 64x64 and
512x512 (prefill x decode) instances, and what narrowing the instances it predicts loses.

    .venv/bin/python -m loadtest.router.placement_scale            # under a minute on 2 cores
    .venv/bin/python -m loadtest.router.placement_scale --smoke    # seconds: a check, not figures

1. Decision time: `GoodputPolicy.choose_pair` as the server builds it (the config's
   `placement_candidates`, 12 by default) on synthetic instance states: prefill instances with
   known prompts queued (0-8, 32-2048 tokens, part computed), decode instances with batches of
   0-128 requests, residuals, a few holding the cached prefix of some prompts (shared prefixes
   of up to 1024 tokens). Prints `decision p50 ms @PxD` and `decision p99 ms @PxD`, and the full
   search's (`placement_candidates: 0`) p50 for comparison.
2. Goodput lost to narrowing: the simulator (`disagg.planner.simulator`, the same policy class
   on simulated engines) runs one Poisson workload (prompts 64-1024, outputs 32-384 tokens) on
   N prefill + N decode instances of llama2-7b on A100-80GB (the roofline profile), at a rate
   near the full search's saturation (9 req/s a pair: about 90% SLO attainment at TTFT 250 ms,
   TPOT 25 ms), once with the full search and once narrowed. Prints `goodput ratio @NxN`
   (narrowed / full, requests/s meeting both SLOs). 512x512 is left out by default: its 46,000
   requests over 10 s at the full search's 30-50 ms a decision on the simulated instances are
   half an hour or more. `--goodput-sizes 512 --seconds 1.25` keeps 64x64's 5,760 requests
   (about 4 minutes on 2 cores), but so short a window ends before the decode batches build up:
   every request meets both SLOs with either policy. `--seconds 6` (27,648 requests, about 18
   minutes) reaches the load where requests miss (95% met; 64x64: 95% at 6 s, 88% at 10 s).

Decision times are the process's own (perf_counter around each call), on whatever else the
machine runs: name the CPU with the figures.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from disagg.bench.results import host_line
from disagg.config import ServingConfig
from disagg.placement.factory import placement_policy
from disagg.placement.latency_model import StepModel
from disagg.placement.policies import RequestShape
from disagg.placement.prefill_queue import Decodes, QueuedPrompt
from disagg.planner.deployment import Deployment
from disagg.planner.roofline import roofline_profile
from disagg.planner.simulator import num_met, percentile
from disagg.planner.workload import SimRequest, poisson_arrivals
from disagg.slo import SLO

MODEL, HARDWARE = "llama2-7b", "a100-80gb"
SLO_TTFT_MS, SLO_TPOT_MS = 250.0, 25.0
TARGETS = SLO(SLO_TTFT_MS, SLO_TPOT_MS)
BLOCK = 16
NUM_PREFIXES = 32  # shared prompt prefixes the synthetic requests draw from


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="8,64,512", help="instances per pool for the decision times")
    p.add_argument("--goodput-sizes", default="8,64", help="instances per pool for the simulated goodput ratio")
    p.add_argument("--decisions", type=int, default=1000, help="timed decisions per size")
    p.add_argument("--full-decisions", type=int, default=100, help="timed full-search decisions per size")
    p.add_argument("--rate-per-pair", type=float, default=9.0, help="simulated req/s per prefill+decode pair")
    p.add_argument("--seconds", type=float, default=10.0, help="simulated seconds of arrivals")
    p.add_argument("--candidates", type=int, help="placement_candidates narrowed (default: the config's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="8x8 and 64x64, few decisions, a short 8x8 simulation")
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes, args.goodput_sizes, args.decisions, args.full_decisions, args.seconds = "8,64", "8", 50, 10, 2.0
    return args


# ---- 1. decision time on synthetic states ---------------------------------------------------------
@dataclass(eq=False)
class SyntheticInstance:
    """An instance's state as the goodput policy reads it (disagg.placement.predictor's sides)."""

    instance_id: str
    step_model: StepModel
    queued_prompts: tuple = ()
    predicted_queue_tokens: int = 0
    queue_progress_ms: float = 0.0
    decode_batch: int = 0
    decode_context_tokens: int = 0
    free_blocks: int = 5000
    residual_ms: float = 0.0
    warm: frozenset = field(default_factory=frozenset)
    prefill_budget: int = 512
    prefill_chunk_cap: int | None = 128  # the engine's default: a quarter of the budget
    prefill_by_work: bool = True  # the engine's default
    backlog_tokens: int = 0
    arriving_tokens_per_ms: float = 0.0
    prefill_calibrated: bool = True
    decode_calibrated: bool = True
    riding_decodes: Decodes | None = None

    def ttft_residual_ms(self, model_ms: float) -> float:
        return self.residual_ms

    def tpot_residual_ms(self, model_ms: float) -> float:
        return self.residual_ms

    def cached_tokens(self, block_hashes) -> int:
        hits = 0
        for h in block_hashes:
            if h not in self.warm:
                break
            hits += 1
        return hits * BLOCK


def prefix_hashes(prefix: int, blocks: int) -> tuple[int, ...]:
    return tuple(prefix * 10_000 + b for b in range(blocks))


def synthetic_pools(n: int, model: StepModel, rng: random.Random) -> tuple[list, list]:
    prefills = []
    for i in range(n):
        queue = [QueuedPrompt(rng.randint(32, 2048)) for _ in range(rng.choice([0, 0, 1, 2, 4, 8]))]
        if queue and rng.random() < 0.5:
            queue[0] = QueuedPrompt(queue[0].num_tokens, rng.randrange(queue[0].num_tokens))
        warm = frozenset()
        if rng.random() < 0.25:  # a few prefixes cached here
            warm = frozenset(h for prefix in rng.sample(range(NUM_PREFIXES), 2) for h in prefix_hashes(prefix, 64))
        prefills.append(SyntheticInstance(
            f"prefill-{i}", model, tuple(queue), sum(q.num_new for q in queue), rng.uniform(0, 20) if queue else 0.0,
            residual_ms=rng.uniform(0, 5), warm=warm, arriving_tokens_per_ms=rng.uniform(0, 2)))  # fmt: skip
    decodes = []
    for j in range(n):
        batch = rng.randint(0, 128)
        decodes.append(SyntheticInstance(
            f"decode-{j}", model, decode_batch=batch, decode_context_tokens=batch * rng.randint(100, 1500),
            free_blocks=rng.randint(0, 8000), residual_ms=rng.uniform(0, 2)))  # fmt: skip
    return prefills, decodes


def synthetic_request(rng: random.Random) -> RequestShape:
    prompt = rng.randint(32, 2048)
    shared = rng.randint(1, min(64, prompt // BLOCK)) if prompt >= BLOCK and rng.random() < 0.5 else 0
    hashes = prefix_hashes(rng.randrange(NUM_PREFIXES), shared) + tuple(rng.getrandbits(62) for _ in range(3))
    slo = SLO(SLO_TTFT_MS * 4, SLO_TPOT_MS * 2)
    return RequestShape(prompt, rng.randint(16, 512), slo, blocks_needed=-(-prompt // BLOCK), block_hashes=hashes)


def decision_ms(policy, n: int, decisions: int, model: StepModel, seed: int) -> list[float]:
    """Each decision on a state of its own kind: a new state every 20 decisions."""
    rng, times = random.Random(seed), []
    while len(times) < decisions:
        prefills, decodes = synthetic_pools(n, model, rng)
        for _ in range(min(20, decisions - len(times))):
            request = synthetic_request(rng)
            start = time.perf_counter()
            policy.choose_pair(prefills, decodes, request)
            times.append((time.perf_counter() - start) * 1e3)
    return times


def decision_times(args, settings: dict, model: StepModel) -> None:
    narrowed = placement_policy(ServingConfig.from_dict(settings))
    full = placement_policy(ServingConfig.from_dict({**settings, "placement_candidates": 0}))
    decision_ms(narrowed, 8, 20, model, args.seed)  # warm up
    for n in _sizes(args.sizes):
        times = decision_ms(narrowed, n, args.decisions, model, args.seed)
        print(f"decision p50 ms @{n}x{n}: {percentile(times, 50):.3f}")
        print(f"decision p99 ms @{n}x{n}: {percentile(times, 99):.3f}", flush=True)
        full_n = args.full_decisions if n <= 64 else max(1, args.full_decisions // 10)
        times = decision_ms(full, n, full_n, model, args.seed)
        print(
            f"  full search: decision p50 ms @{n}x{n}: {statistics.median(times):.3f} ({full_n} decisions)", flush=True
        )


# ---- 2. goodput lost to narrowing, simulated ---------------------------------------------------------
def workload(n: int, args) -> list[SimRequest]:
    rate = args.rate_per_pair * n
    arrivals = poisson_arrivals(max(1, int(rate * args.seconds)), rate, seed=args.seed + 1)
    rng = random.Random(args.seed + 2)
    return [SimRequest(i, t, rng.randint(64, 1024), rng.randint(32, 384)) for i, t in enumerate(arrivals)]


def simulated_goodput(config: ServingConfig, profile, requests: list[SimRequest]) -> tuple[float, float]:
    """(requests/s meeting both SLOs, wall seconds the simulation took)."""
    start = time.perf_counter()
    records = Deployment(config, {"prefill": profile, "decode": profile}, from_hardware=True).simulator().run(requests)
    duration_s = max(r.arrival_s for r in requests) or 1.0
    return num_met(records, TARGETS) / duration_s, time.perf_counter() - start


def goodput_ratios(args, settings: dict, profile) -> None:
    for n in _sizes(args.goodput_sizes):
        sized = {**settings, "prefill": {"num_instances": n}, "decode": {"num_instances": n}}
        requests = workload(n, args)
        narrowed, narrowed_s = simulated_goodput(ServingConfig.from_dict(sized), profile, requests)
        full_config = ServingConfig.from_dict({**sized, "placement_candidates": 0})
        full, full_s = simulated_goodput(full_config, profile, requests)
        print(f"  {n}x{n}: {len(requests)} requests in {args.seconds:g} simulated s, goodput req/s narrowed {narrowed:.2f} ({narrowed_s:.0f} s to "
              f"simulate), full {full:.2f} ({full_s:.0f} s)")  # fmt: skip
        print(f"goodput ratio @{n}x{n}: {narrowed / full if full else float('nan'):.4f}", flush=True)


def _sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(host_line(), flush=True)
    settings = {"slo": TARGETS.to_dict(), "ray_address": "auto"}  # not this host's cores
    if args.candidates is not None:
        settings["placement_candidates"] = args.candidates
    candidates = ServingConfig.from_dict(settings).placement_candidates
    profile = roofline_profile(MODEL, HARDWARE)
    print(f"placement_candidates: {candidates}; {MODEL} on {HARDWARE} (roofline)")
    decision_times(args, settings, profile.step_model(1, 1))
    goodput_ratios(args, settings, profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
