"""What driving a TP x PP instance's other ranks costs per step (issue 38, item 3).

The same model served three ways, each by a `disagg serve` of its own (one colocated instance,
one torch thread per worker): TP1 (one worker), TP2 and PP2 (two workers, rank 0 driving the
other). Each decodes the same prompt at batch 1, one request at a time; a request's ms per step
is its client-side TPOT ((last token - first token) / (tokens - 1)). Prints the median over the
requests for each plan, and TP2 - TP1 and PP2 - TP1: the second worker's cost per step (its
share of the compute saved, the per-step hand-off and the collectives paid).

`--before REV` also serves the code at git revision REV (a temporary worktree, its servers
started from there, with it on their PYTHONPATH: disagg.bench.launcher's `code`), so the step channel (this tree) and the Ray call per
step (the revision before it) are compared in one run. All servers are up at once and take
turns request by request, every round in another order, so that the machine's drift falls on
each alike.

    .venv/bin/python -m loadtest.service.shard_step --before 1285241 --steps 64 --rounds 8
    .venv/bin/python -m loadtest.service.shard_step --steps 8 --rounds 1      # a quick check that it runs
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from disagg.bench.launcher import Deployment
from disagg.bench.results import REPO, host_line, write_results
from disagg.client import DisaggClient, generate_request

PLANS = {"TP1": (1, 1), "TP2": (2, 1), "PP2": (1, 2)}
PROMPT = list(range(100, 132))


def serving_config(tp: int, pp: int, args) -> dict:
    return {
        "mode": "colocated",
        "engine": {"model": args.model, "dtype": "float32", "weights": args.weights, "max_num_batched_tokens": 256},
        "colocated": {"num_instances": 1, "tensor_parallel_size": tp, "pipeline_parallel_size": pp},
        "threads_per_worker": 1,
        "cpu_binding": "off",  # the servers share the machine's cores alike
        "placement": "least_work",
        "calibration_s": 0,
        "replan": False,
        "metrics_port": None,
    }


@contextlib.contextmanager
def code_at(revision: str):
    """A detached worktree of this repository at `revision`, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="bench-shard-step-") as parent:
        path = Path(parent) / "code"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), revision], check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)


def start_servers(codes: dict[str, Path], args, stack: contextlib.ExitStack) -> dict[tuple[str, str], str]:
    """(code label, plan) -> the server's address; every server stops when `stack` closes."""
    addresses = {}
    for label, code in codes.items():
        for plan, (tp, pp) in PLANS.items():
            settings = serving_config(tp, pp, args)
            server = Deployment(settings, workdir=args.out, name=f"{label}-{plan}".replace(" ", "-"), code=code)
            stack.enter_context(server)
            addresses[(label, plan)] = server.address
            print(f"  {label} {plan} serving at {server.address}", flush=True)
    return addresses


def ms_per_step(address: str, steps: int) -> float:
    """One request decoding `steps` tokens after its first, alone on its instance."""
    request = generate_request(prompt_token_ids=PROMPT, temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    arrivals, tokens = [], 0
    with DisaggClient(address) as client:
        for message in client.stream(request, timeout=600):
            if message.token_ids:
                arrivals.append(time.perf_counter())
                tokens += len(message.token_ids)
    if tokens < 2:
        raise RuntimeError(f"{address} returned {tokens} tokens")
    return (arrivals[-1] - arrivals[0]) * 1e3 / (tokens - 1)  # the first token came alone, from the prefill


def measure(addresses: dict, args) -> dict[tuple[str, str], list[float]]:
    keys = list(addresses)
    for key in keys:  # one unmeasured request each: kernels built, caches warm
        ms_per_step(addresses[key], args.steps)
    results: dict = {key: [] for key in keys}
    for round_index in range(args.rounds):
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            results[key].append(ms_per_step(addresses[key], args.steps))
        print(f"  round {round_index + 1}/{args.rounds} done", flush=True)
    return results


def report(results: dict, labels: list[str]) -> None:
    median = {key: statistics.median(values) for key, values in results.items()}
    print(f"\nms per decode step at batch 1 (median of {len(next(iter(results.values())))} requests):")
    print(f"{'code':<10}" + "".join(f"{plan:>10}" for plan in PLANS) + f"{'TP2-TP1':>10}{'PP2-TP1':>10}")
    for label in labels:
        row = [median[(label, plan)] for plan in PLANS]
        extra = [median[(label, "TP2")] - median[(label, "TP1")], median[(label, "PP2")] - median[(label, "TP1")]]
        print(f"{label:<10}" + "".join(f"{v:>10.2f}" for v in row + extra))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="git revision to compare with (e.g. the commit before the step channel)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per request")
    parser.add_argument("--rounds", type=int, default=8, help="measured requests per server")
    parser.add_argument("--model", default="random:tiny", help="the default SmolLM2-135M has 9 heads: no TP2")
    parser.add_argument(
        "--weights", default="fp32", help="EngineConfig.weights (fp32: dense, as a GPU would hold them)"
    )
    parser.add_argument("--out", type=Path, default=None, help="where configs and server logs go (default: a temp dir)")
    args = parser.parse_args(argv)
    args.out = (args.out or Path(tempfile.mkdtemp(prefix="bench-shard-step-out-"))).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{host_line()}; logs in {args.out}", flush=True)
    with contextlib.ExitStack() as stack:
        codes = {"this tree": REPO}
        if args.before:
            codes = {args.before[:10]: stack.enter_context(code_at(args.before)), **codes}
        addresses = start_servers(codes, args, stack)
        results = measure(addresses, args)
    report(results, list(codes))
    medians = {f"{label} {plan}": statistics.median(values) for (label, plan), values in results.items()}
    write_results(args.out / "shard_step.json", {"ms_per_step_p50": medians}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
