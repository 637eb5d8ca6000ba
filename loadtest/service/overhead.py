"""What the service costs on top of the engine, at low load (issue 4's benchmark).

The same 32 requests, one at a time: (a) offline through the engine in this process, with one
torch thread as each worker has; (b) through gRPC, the router, the Ray prefill and decode
actors and the KV transfer, served by a `disagg serve` process (the default deployment: 1
prefill + 1 decode worker, one thread each), this process being its gRPC client. The sides
take turns request by request, in every order in turn, so that the machine's drift falls on
each alike. Before they are measured, each side meets every prompt length once (oneDNN's
kernels are built per length and kept by the process; `kernel_warmup`). Prints mean and p50
TTFT and TPOT for both and their differences.
Target: the service adds at most 5 ms to p50 TTFT and keeps TPOT within 5%.

A third side is the control for the worker's prefill: the same offline engine in a plain process
of its own (no Ray, no service), given the same requests in the same turns. The worker's prefill
minus the offline one is what the service makes the compute cost, only insofar as it exceeds this
twin's minus the offline one (what computing in another process alone makes).

    .venv/bin/python -m loadtest.service.overhead [--requests 32] [--max-tokens 32] [--runs 1] [--cpu-binding auto|on|off|on,off] [--out results.json]

Where the server binds its prefill engine thread to CPUs of its own (disagg.hosts.cpu_binding;
by default only with 3 CPUs or more), the offline engine and its twin compute on those CPUs too and the
client runs beside the server's other threads, so that both sides compute under the same
conditions.

On a shared 2-core machine the same prompt computes 5-15 ms apart from one request to the next
(one idle process's median prefill, taken every 3 s, moved between 56 and 80 ms over 90 s), and
two fresh processes compute a few percent apart (also two identical offline ones), so one
run of 32 requests can land several ms either side. `--runs 4` repeats it with fresh processes;
the 95% CI it prints resamples runs and requests, so it includes what differs between runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import multiprocessing
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import torch

from disagg.bench.metrics import median_ci, median_difference_ci
from disagg.hosts.cpu_binding import bind_this_thread, plan_cpus
from disagg.config import CPU_BINDINGS
from disagg.bench.launcher import Deployment, add_config_argument
from disagg.bench.results import host_line, write_results

SERVER_SETTINGS = {
    "threads_per_worker": 1,
    "metrics_port": None,
}  # the default deployment, one thread per worker as offline
# A fresh Ray cluster keeps the CPU busy for a few seconds after start (worker prestart, its own
# services), and each worker packs its weights on first use: the measurement starts after that.
WARMUP_SETTLE_S = 3.0
TWIN_TIMEOUT_S = 300.0  # for the twin process to load its model, or to answer one request
TOPICS = [
    "the ocean",
    "a mountain village",
    "how bread is made",
    "the history of clocks",
    "a friendly robot",
    "winter in the city",
    "the planets",
    "a chess game",
]


def make_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        detail = " ".join(
            rng.choice(["Please", "be", "vivid", "and", "precise", "about", "it", "in", "detail"])
            for _ in range(rng.randint(0, 40))
        )
        prompts.append(f"Write a short paragraph about {topic}. {detail}")
    return prompts


class Offline:
    """The engine in this process, one request at a time."""

    def __init__(self, max_tokens: int):
        from disagg.config import EngineConfig
        from disagg.engine.engine import LLMEngine
        from disagg.request import SamplingParams

        self.engine = LLMEngine(EngineConfig(num_threads=1))
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.count = 0
        self.prefills = []  # each request's scheduled-to-first-token, as the worker reports its own

    def run(self, ids: list[int], max_tokens: int | None = None) -> tuple[float, float]:
        self.count += 1
        params = self.params if max_tokens is None else dataclasses.replace(self.params, max_tokens=max_tokens)
        start, first = time.perf_counter(), None
        self.engine.add_request(str(self.count), prompt_token_ids=ids, sampling_params=params)
        timings = self.engine.scheduler.waiting[-1].timings
        while self.engine.has_unfinished_requests():
            for _ in self.engine.step():
                first = first or time.perf_counter()
        self.prefills.append(timings.first_token - timings.first_scheduled)
        return _ttft_tpot(start, first, time.perf_counter(), params.max_tokens)


class OfflineTwin:
    """The offline engine in a plain process of its own, run request by request over a pipe;
    keeps each request's scheduled-to-first-token time as the twin measured it."""

    def __init__(self, max_tokens: int, cpus: set[int] | None):
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_twin_main, args=(child_conn, max_tokens, cpus), name="offline-twin", daemon=True
        )
        self._process.start()
        self._receive()  # loaded
        self.prefills = []

    def run(self, ids: list[int], max_tokens: int | None = None) -> None:
        self._conn.send((ids, max_tokens))
        self.prefills.append(self._receive())

    def _receive(self):
        if not self._conn.poll(TWIN_TIMEOUT_S):
            raise TimeoutError(f"the offline twin did not answer within {TWIN_TIMEOUT_S:.0f} s")
        return self._conn.recv()

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass  # it is gone already
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()


def _twin_main(conn, max_tokens: int, cpus: set[int] | None) -> None:
    torch.set_num_threads(1)
    if cpus is not None:
        bind_this_thread(cpus)
    offline = Offline(max_tokens)
    conn.send("loaded")
    while (request := conn.recv()) is not None:
        offline.run(*request)
        conn.send(offline.prefills[-1])


class Service:
    """A real `disagg serve` process (as users run it), so that this client and the server's
    frontend do not share a Python process (and its GIL); keeps each stream's server timings."""

    def __init__(self, client, max_tokens: int):
        self.client = client
        self.max_tokens = max_tokens
        self.timings = []

    def run(self, ids: list[int], max_tokens: int | None = None) -> tuple[float, float]:
        from disagg.client import generate_request

        max_tokens = max_tokens or self.max_tokens
        start, first = time.perf_counter(), None
        for msg in self.client.stream(
            generate_request(prompt_token_ids=ids, temperature=0.0, max_tokens=max_tokens, ignore_eos=True), timeout=300
        ):
            if msg.token_ids and first is None:
                first = time.perf_counter()
            if msg.finished:
                self.timings.append(msg.timings)
        return _ttft_tpot(start, first, time.perf_counter(), max_tokens)


def measure(
    prompts: list[list[int]], warmup: list[list[int]], max_tokens: int, settings: dict, base: str | None = None
):
    """The sides take turns request by request (in every order in turn), so that the machine's
    drift and background load fall on each alike. `settings` over the `base` config file: the
    server's."""
    from disagg.client import DisaggClient

    results = {"offline": [], "service": [], "twin": []}
    own_cpus = os.sched_getaffinity(0)
    with Deployment(settings, base=base, name="bench-service") as server:
        plan = _server_cpu_plan(server.config, own_cpus)
        try:
            with ExitStack() as stack:
                client = stack.enter_context(DisaggClient(server.address))
                sides = {"offline": Offline(max_tokens), "service": Service(client, max_tokens)}
                sides["twin"] = OfflineTwin(max_tokens, plan.engine_cpus("prefill", 0) if plan is not None else None)
                stack.callback(sides["twin"].close)
                run = {name: side.run for name, side in sides.items()}
                if plan is not None:
                    # The client gets a thread where the server's other threads run; this one,
                    # the offline engine's, moves to the prefill engine's CPUs for good (moved
                    # back and forth per request, its prefills came out 10% slower than unbound).
                    client_thread = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="client"))
                    client_thread.submit(int).result()  # started now, so that it inherits this thread's CPUs
                    run["service"] = lambda *request: client_thread.submit(sides["service"].run, *request).result()
                    bind_this_thread(plan.engine_cpus("prefill", 0))
                for ids in warmup:
                    for name in sides:
                        run[name](ids)
                for ids in kernel_warmup(prompts):
                    for name in sides:
                        run[name](ids, 2)
                sides["service"].timings.clear()
                sides["offline"].prefills.clear()
                sides["twin"].prefills.clear()
                time.sleep(WARMUP_SETTLE_S)
                orders = list(itertools.permutations(sides))
                for i, ids in enumerate(prompts):
                    for name in orders[i % len(orders)]:
                        results[name].append(run[name](ids))
        finally:
            bind_this_thread(own_cpus)
    return (
        results["offline"],
        results["service"],
        sides["service"].timings,
        sides["offline"].prefills,
        sides["twin"].prefills,
    )


def kernel_warmup(prompts: list[list[int]]) -> list[list[int]]:
    """One prompt of each length measured, its tokens shuffled (so that no prefix of it is cached).

    oneDNN builds GEMM kernels for each row count it meets and keeps them for the process
    (disagg/engine/layers/cpu_gemm.py), so a fresh process prefills a length it has not seen
    1-13 ms slower at p50 than an engine in a process that has (session 15). This process
    keeps its kernels from run to run while the server and the twin start afresh: without
    these, from the second run on the offline side computed ahead of both.
    """
    rng = random.Random(len(prompts))
    by_length = {len(ids): ids for ids in prompts}
    return [rng.sample(ids, len(ids)) for _, ids in sorted(by_length.items())]


def _server_cpu_plan(settings: dict, own_cpus: set[int]):
    """Where the server binds its threads (disagg.hosts.cpu_binding): its prefill engine
    thread on CPUs of its own, every other thread off them. This process's threads (the gRPC
    client's) join the server's others; the offline engine computes on the prefill engine's CPUs
    (`measure`), so that both sides compute under the same conditions. Returns the plan, with
    this thread on the others' CPUs."""
    from disagg.config import ServingConfig

    plan = plan_cpus(ServingConfig.from_dict(settings), own_cpus)
    if plan is not None:
        bind_this_thread(plan.framework)
    return plan


def _ttft_tpot(start: float, first: float, end: float, num_tokens: int) -> tuple[float, float]:
    return first - start, (end - first) / (num_tokens - 1)


def summarize(name: str, results: list[tuple[float, float]]) -> dict:
    ttft, tpot = [r[0] * 1e3 for r in results], [r[1] * 1e3 for r in results]
    return {
        "name": name,
        "ttft_mean_ms": statistics.mean(ttft),
        "ttft_p50_ms": statistics.median(ttft),
        "tpot_mean_ms": statistics.mean(tpot),
        "tpot_p50_ms": statistics.median(tpot),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--runs", type=int, default=1, help="repeat with a fresh server and a fresh offline engine each time"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=4, help="requests run (and not measured) first on both sides")
    parser.add_argument(
        "--cpu-binding",
        type=_bindings,
        default=["auto"],
        help="the server's cpu_binding (auto, on, off), or several comma-separated (on,off) to compare them, taking turns run by run",
    )
    parser.add_argument("--out")
    add_config_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(host_line(), flush=True)
    from disagg.config import EngineConfig
    from disagg.engine.loader import load_model_source
    from disagg.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(load_model_source(EngineConfig().model, cache_dir=EngineConfig().cache_dir).tokenizer)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in make_prompts(args.requests, args.seed)
    ]
    warmup = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}])
        for p in make_prompts(args.warmup, args.seed + 1)
    ]
    runs = {binding: [] for binding in args.cpu_binding}
    for i in range(args.runs):
        # Settings compared take turns, in alternating order, so that the machine's drift falls on each alike.
        for binding in args.cpu_binding[:: 1 if i % 2 == 0 else -1]:
            settings = {**SERVER_SETTINGS, "cpu_binding": binding}
            runs[binding].append(measure(prompts, warmup, args.max_tokens, settings, args.config))
    figures = {}
    for binding, its_runs in runs.items():
        print(
            f"\ncpu_binding {binding}: {args.requests} requests x {args.runs} run(s), prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {args.max_tokens} output tokens, one at a time"
        )
        figures[binding] = report(its_runs)
    if args.out:
        write_results(args.out, figures, args)
    return 0


def _bindings(text: str) -> list[str]:
    bindings = text.split(",")
    if any(b not in CPU_BINDINGS for b in bindings) or len(set(bindings)) < len(bindings):
        raise argparse.ArgumentTypeError(
            f"expected one of {', '.join(CPU_BINDINGS)} or several, comma-separated; got {text!r}"
        )
    return bindings


def report(runs: list[tuple[list, list, list, list, list]]) -> dict:
    """Prints the figures of all runs pooled, and what the added TTFT is in each run."""
    offline, service, phases = ([x for run in runs for x in run[k]] for k in range(3))
    a = summarize("offline engine", offline)
    b = summarize("service (gRPC + Ray + KV transfer)", service)
    print(f"{'':38} {'TTFT mean':>10} {'TTFT p50':>10} {'TPOT mean':>10} {'TPOT p50':>10}   (ms)")
    for r in (a, b):
        print(
            f"{r['name']:38} {r['ttft_mean_ms']:10.1f} {r['ttft_p50_ms']:10.1f} {r['tpot_mean_ms']:10.2f} {r['tpot_p50_ms']:10.2f}"
        )
    added = b["ttft_p50_ms"] - a["ttft_p50_ms"]
    added_ci = median_difference_ci(*([[r[0] * 1e3 for r in run[side]] for run in runs] for side in (0, 1)))
    # The same prompt's TTFT on both sides, request by request: prompts of 40-80 tokens spread
    # TTFT over 50-180 ms, so the difference of two p50s moves with which requests sit mid-pack.
    per_request = [[(s[0] - o[0]) * 1e3 for s, o in zip(run[1], run[0])] for run in runs]
    paired, low, high = _median_with_ci(per_request)
    ratio_tpot = b["tpot_p50_ms"] / a["tpot_p50_ms"]
    print(
        f"service adds {added:+.1f} ms to p50 TTFT (95% CI {added_ci[0]:+.1f} to {added_ci[1]:+.1f}), {paired:+.1f} ms per request at p50 (95% CI {low:+.1f} to {high:+.1f}); target <= 5 ms"
    )
    print(
        f"TPOT p50 ratio {ratio_tpot:.3f} (target <= 1.05); TTFT mean ratio {b['ttft_mean_ms'] / a['ttft_mean_ms']:.3f}"
    )
    if len(runs) > 1:
        print(
            "added per request at p50, run by run: "
            + ", ".join(f"{statistics.median(r):+.1f}" for r in per_request)
            + " ms"
        )
    # Where the added TTFT goes, request by request (p50 of each part; the server's parts from
    # each stream's last message): the prefill itself (the worker's compute against the offline
    # engine's TTFT for the same prompt), the router and request links, and gRPC.
    parts = {
        "prefill in the worker - offline TTFT": [t.prefill_s - o[0] for t, o in zip(phases, offline)],
        "router, links, hand-offs": [t.ttft_s - t.prefill_s for t in phases],
        "gRPC (client - frontend)": [s[0] - t.ttft_s for s, t in zip(service, phases)],
    }
    print(
        "added TTFT per request, p50 of each part: "
        + ", ".join(f"{name} {statistics.median(v) * 1e3:+.1f} ms" for name, v in parts.items())
    )
    # On a shared machine the same prompt computes 5-15 ms apart from one request to the next,
    # and two fresh processes a few percent apart, also two identical ones: that is what the CI
    # above carries. The service's own hops, measured inside each request, do not.
    hops = [[(s[0] - t.prefill_s) * 1e3 for s, t in zip(run[1], run[2])] for run in runs]
    own_hops, low_hops, high_hops = _median_with_ci(hops)
    print(
        f"the service's own hops (client TTFT - worker prefill) per request: p50 {own_hops:.1f} ms (95% CI {low_hops:.1f} to {high_hops:.1f})"
    )
    # The control: a second process computing the same prompts with nothing of the service in it.
    worker_gap = [[(t.prefill_s - p) * 1e3 for t, p in zip(run[2], run[3])] for run in runs]
    twin_gap = [[(q - p) * 1e3 for q, p in zip(run[4], run[3])] for run in runs]
    figures = {"worker": _median_with_ci(worker_gap), "twin": _median_with_ci(twin_gap)}
    print(
        "prefill (scheduled to first token) minus the offline engine's, per request: "
        + ", ".join(
            f"{name} p50 {m:+.1f} ms (95% CI {lo:+.1f} to {hi:+.1f})"
            for name, (m, lo, hi) in (
                ("the worker's", figures["worker"]),
                ("a twin offline process's (the control)", figures["twin"]),
            )
        )
    )
    if len(runs) > 1:
        print(
            "the same, run by run: worker "
            + ", ".join(f"{statistics.median(r):+.1f}" for r in worker_gap)
            + "; twin "
            + ", ".join(f"{statistics.median(r):+.1f}" for r in twin_gap)
            + " ms"
        )
    # Each request's figures too, run by run, so that a saved run can be analysed again.
    per_run = [
        {
            "offline_ttft_ms": [o[0] * 1e3 for o in run[0]],
            "service_ttft_ms": [x[0] * 1e3 for x in run[1]],
            "worker_prefill_ms": [t.prefill_s * 1e3 for t in run[2]],
            "offline_prefill_ms": [p * 1e3 for p in run[3]],
            "twin_prefill_ms": [q * 1e3 for q in run[4]],
        }
        for run in runs
    ]
    return {
        "offline": a,
        "service": b,
        "runs": len(runs),
        "per_run": per_run,
        "ttft_p50_added_ms": added,
        "ttft_p50_added_ci95_ms": list(added_ci),
        "ttft_added_per_request_p50_ms": paired,
        "ttft_added_per_request_ci95_ms": [low, high],
        "tpot_p50_ratio": ratio_tpot,
        "own_hops_p50_ms": own_hops,
        "prefill_minus_offline_ms": figures,
    }


def _median_with_ci(runs: list[list[float]]) -> tuple[float, float, float]:
    """The median of all runs' values pooled, and its 95% CI (runs, then values, resampled)."""
    return (statistics.median(sum(runs, [])), *median_ci(runs))


if __name__ == "__main__":
    sys.exit(main())
