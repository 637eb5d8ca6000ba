"""How much slower an engine step runs while another engine on the same host computes.

A profile (`disagg profile`) times the engine alone. A disaggregated deployment on one CPU host
runs its prefill and decode workers side by side, each a process with its own threads, and when
both compute they share the host's memory bandwidth and, under a hypervisor, the physical cores
behind its vCPUs. This measures that, as the simulator models it
(`disagg.placement.latency_model.HostSharing`): the engine's steps in this process, alone and
while a second engine process (same threads) runs steps without pause, for each kind of step here
(prompt chunks, decodes) and each kind of step there: slowdown[here][there] is the median step
beside the busy partner over the median alone just before, the median of a few such rounds.

    .venv/bin/python -m loadtest.host.sharing [--threads 1] [--write-profile P]

`--write-profile` stores the factors as the profile's `host_sharing` (run it on the machine and
day the profile was measured: both describe the same host). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path

from disagg.bench.results import host_line

PROMPT_LEN = 128
DECODE_BATCH = 8
KINDS = ("prefill", "decode")


def make_engine(threads: int):
    import torch

    from disagg.config import EngineConfig
    from disagg.engine.engine import LLMEngine

    torch.set_num_threads(threads)
    return LLMEngine(EngineConfig(num_threads=threads, enable_prefix_caching=False))


class Steps:
    """Steps of one kind on one engine: whole 128-token prompts, or decodes of a batch of 8."""

    def __init__(self, engine, kind: str, seed: int):
        self.engine, self.kind = engine, kind
        self.rng = random.Random(seed)
        self.count = 0

    def _add(self, max_tokens: int) -> None:
        from disagg.request import SamplingParams

        self.count += 1
        prompt = [self.rng.randrange(100, 40000) for _ in range(PROMPT_LEN)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(f"{self.kind}-{self.count}", prompt_token_ids=prompt, sampling_params=params)

    def timed_step(self) -> float:
        """One step of this kind, in ms (any set-up step it needs first is not timed)."""
        if self.kind == "prefill":
            self._add(max_tokens=1)
        elif not self.engine.has_unfinished_requests():
            for _ in range(DECODE_BATCH):
                self._add(max_tokens=64)
            self.engine.step()  # their prefill
        started = time.perf_counter()
        self.engine.step()
        return (time.perf_counter() - started) * 1e3


def background(kind: str, threads: int, ready, running, stop) -> None:
    """The partner: steps of `kind` without pause while `running` is set, idle otherwise."""
    steps = Steps(make_engine(threads), kind, seed=1)
    for _ in range(3):
        steps.timed_step()  # warm-up: kernels built per shape
    ready.set()
    while not stop.is_set():
        if running.wait(0.05):
            steps.timed_step()


def median_ms(steps: Steps, count: int) -> float:
    return statistics.median(steps.timed_step() for _ in range(count))


def measure(threads: int, count: int, rounds: int) -> dict:
    """Per partner kind, `rounds` times: this engine's steps alone, then beside the partner; the
    slowdown is the median of the rounds' ratios (a machine whose speed drifts over minutes moves
    both sides of a round alike)."""
    engine = make_engine(threads)
    steps = {kind: Steps(engine, kind, seed=2) for kind in KINDS}
    for s in steps.values():
        median_ms(s, 3)  # warm-up
    ctx = mp.get_context("spawn")
    out = {"threads": threads, "rounds": [], "slowdown": {kind: {} for kind in KINDS}}
    for other in KINDS:
        ready, running, stop = ctx.Event(), ctx.Event(), ctx.Event()
        partner = ctx.Process(target=background, args=(other, threads, ready, running, stop), daemon=True)
        partner.start()
        if not ready.wait(600):
            raise RuntimeError("the partner engine did not start")
        ratios = {kind: [] for kind in KINDS}
        for _ in range(rounds):
            running.clear()
            time.sleep(0.5)  # the partner's step under way ends
            alone = {kind: median_ms(s, count) for kind, s in steps.items()}
            running.set()
            shared = {kind: median_ms(s, count) for kind, s in steps.items()}
            out["rounds"].append({"partner": other, "alone_ms": alone, "shared_ms": shared})
            for kind in KINDS:
                ratios[kind].append(shared[kind] / alone[kind])
        stop.set()
        partner.join(60)
        for kind in KINDS:
            out["slowdown"][kind][other] = round(statistics.median(ratios[kind]), 3)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads of each engine")
    p.add_argument("--steps", type=int, default=7, help="timed steps per median")
    p.add_argument("--rounds", type=int, default=3, help="alone / beside rounds per partner kind")
    p.add_argument("--write-profile", help="store the slowdowns as this profile's host_sharing")
    args = p.parse_args(argv)
    result = measure(args.threads, args.steps, args.rounds)
    result["date"] = time.strftime("%Y-%m-%d")
    result["host"] = host_line()
    print(json.dumps(result, indent=1))
    if args.write_profile:
        path = Path(args.write_profile)
        profile = json.loads(path.read_text())
        profile["host_sharing"] = result["slowdown"]
        profile.setdefault("fit", {})["host_sharing"] = result
        path.write_text(json.dumps(profile, indent=1) + "\n")
        print(f"wrote host_sharing into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
