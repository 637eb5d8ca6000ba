"""`disagg profile`: time the real engine's steps over a grid and fit the latency model to them.

For each TP x PP the engine runs as in a TP x PP instance, but in one process: one thread per
rank, real gloo groups, rank 0 scheduling. Every timed step is a whole `LLMEngine.step()`
(schedule, forward, sample, outputs); what the step held is read from the scheduler's requests
around it, so it is recorded exactly as a simulator driving the same `Scheduler` would see it.
Each grid point is run once to warm up (oneDNN builds kernels per shape on first use), then
`repeats` times; its median is kept. The fit and its held-out errors are in `profile_fit`.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from disagg.config import DEFAULT_MODEL, EngineConfig, ParallelConfig
from disagg.engine.distributed import RankPlace, join_instance, serve_store
from disagg.engine.engine import LLMEngine
from disagg.engine.loader import load_model_source
from disagg.engine.model_config import ModelConfig
from disagg.engine.step_chunks import portable
from disagg.placement.latency_model import Chunk, StepModel, TransferModel
from disagg.placement.profile import Profile, shape_key
from disagg.planner.grid import Grid, make_grid
from disagg.planner.profile_fit import StepSample, fit_shape
from disagg.request import Request, SamplingParams

GREEDY_ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
DECODE_WARM_UP_STEPS = 2  # the first decode steps of a new batch build kernels for its shapes
DECODE_TIMED_STEPS = 3


# ---- the ranks of one instance, in this process -----------------------------------------------------
class ThreadRanks:
    """Rank 0's followers (disagg.engine.kv_connector.Followers): every other rank runs its shard
    of the step on a thread of its own, as a shard worker would in its own process."""

    def __init__(self, num_ranks: int):
        self.engines: list[LLMEngine] = []
        self.pool = futures.ThreadPoolExecutor(max(1, num_ranks))

    def submit(self, chunks) -> "_PendingShards":
        plain = portable(chunks)
        return _PendingShards([self.pool.submit(e.runner.execute_shard, plain) for e in self.engines])

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class _PendingShards:
    def __init__(self, calls: list[futures.Future]):
        self.calls = calls

    def result(self):
        logits = [c.result(timeout=300) for c in self.calls]
        return next((x for x in logits if x is not None), None)


@contextmanager
def instance(config: EngineConfig, tp: int, pp: int) -> Iterator[LLMEngine]:
    """Rank 0's engine of a TP x PP instance whose other ranks are threads of this process."""
    if tp * pp == 1:
        yield LLMEngine(config)
        return
    store, port = serve_store()
    followers = ThreadRanks(tp * pp - 1)

    def build(rank: int) -> LLMEngine:
        place = RankPlace.of_rank(rank, tp, pp)
        groups = join_instance(place, f"127.0.0.1:{port}", torch.device("cpu"), store=store if rank == 0 else None)
        parallel = ParallelConfig(tp, pp, place.tp_rank, place.pp_rank)
        return LLMEngine(config.replace(parallel=parallel), groups=groups, followers=followers if rank == 0 else None)

    with futures.ThreadPoolExecutor(tp * pp) as pool:  # every rank joins its groups at once
        engines = list(pool.map(build, range(tp * pp)))
    followers.engines = engines[1:]
    try:
        yield engines[0]
    finally:
        followers.close()


# ---- driving one engine -----------------------------------------------------------------------------
class StepBench:
    """Puts an engine into the state of a grid point, times its steps and tears the state down."""

    def __init__(self, engine: LLMEngine, seed: int = 0):
        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self._ids = iter(range(1 << 62))

    # ---- one run of a grid point: its steps, the engine left empty ----------------------------
    def prefill(self, lengths: tuple[int, ...]) -> list[StepSample]:
        """One step of whole prompts (and nothing else)."""
        for n in lengths:
            self._add_prompt(n)
        return self._cleared([self.timed_step(sum(lengths))])

    def decode(self, batch: int, context: int) -> list[StepSample]:
        """Decode steps of `batch` requests with contexts around `context`: the median step."""
        self._import_decodes(batch, context)
        for _ in range(DECODE_WARM_UP_STEPS):
            self.timed_step(batch)
        steps = [self.timed_step(batch) for _ in range(DECODE_TIMED_STEPS)]
        middle = steps[len(steps) // 2]  # contexts grow a token a step: the middle one is the median's
        return self._cleared([_with_ms(middle, statistics.median(s.ms for s in steps))])

    def mixed(self, decodes: int, context: int, start: int, num_tokens: int) -> list[StepSample]:
        """`decodes` running plus a prompt chunk of `num_tokens` after `start` computed ones; with
        start > 0 the step that computes the first `start` tokens (with the decodes) comes first."""
        self._import_decodes(decodes, context)
        self._add_prompt(start + num_tokens)
        first = [self.timed_step(decodes + start)] if start else []
        return self._cleared(first + [self.timed_step(decodes + num_tokens)])

    def timed_step(self, budget: int) -> StepSample:
        """One whole engine step under a token budget of `budget`: what it held and how long it took."""
        scheduler = self.engine.scheduler
        # The profiler sets each step's token budget itself, so that the scheduler chunks prompts
        # where the grid wants them chunked.
        scheduler.max_num_batched_tokens = budget
        before = [(r, r.num_computed_tokens) for r in (*scheduler.running, *scheduler.waiting)]
        started = time.perf_counter()
        self.engine.step()
        ms = (time.perf_counter() - started) * 1e3
        return describe_step(before, ms)

    # ---- state ------------------------------------------------------------------------------
    def _add_prompt(self, n: int) -> Request:
        return self.engine.add_request(
            f"p{next(self._ids)}", prompt_token_ids=self._tokens(n), sampling_params=GREEDY_ONE
        )

    def _import_decodes(self, batch: int, context: int) -> None:
        """`batch` requests decoding, contexts spread over [context/2, 3 context/2). They enter as
        on a decode instance, their KV 'received' without computing it: a prefill per grid point
        would cost more than the whole grid, and the values in the KV do not change the timing."""
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for i in range(batch):
            n = max(1, context // 2 + (context * i) // max(1, batch))
            rid = f"d{next(self._ids)}"
            if self.engine.reserve_for_remote_prefill(rid, self._tokens(n), params) is None:
                raise RuntimeError(f"profile: no room for {batch} decodes of ~{context} tokens; lower --max-batch")
            self.engine.finish_kv_import(rid, self.rng.randrange(self.vocab))

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def _cleared(self, steps: list[StepSample]) -> list[StepSample]:
        self._clear()
        return steps

    def _clear(self) -> None:
        for rid in list(self.engine.scheduler.requests):
            self.engine.abort_request(rid)
        if self.engine.num_free_blocks != self.engine.num_total_blocks:
            raise RuntimeError("profile: blocks still held after every request ended")


def describe_step(before: list[tuple[Request, int]], ms: float) -> StepSample:
    """What a step computed, from each request's computed tokens before and after it. A request
    that gained one token after a prompt is a decode (as the model runner decides); its context
    is the tokens it knew: those cached plus the one computed."""
    chunks, decodes, context_sum = [], 0, 0
    for request, computed in before:
        new = request.num_computed_tokens - computed
        if new < 0:
            raise RuntimeError("profile: a request was preempted; the KV cache is too small for the grid")
        if new == 1 and computed > 0:
            decodes, context_sum = decodes + 1, context_sum + computed + 1
        elif new > 0:
            chunks.append(Chunk(computed, new))
    return StepSample(tuple(chunks), decodes, context_sum, ms)


def measure_shape(engine: LLMEngine, grid: Grid, repeats: int, log: Callable[[str], None]) -> list[StepSample]:
    """Every grid point on this engine, in the grid's order (small to large within each kind).
    The whole grid is walked once to warm up, then `repeats` times: a burst of load from
    elsewhere on the machine then spoils one run of a few points, which their medians discard,
    rather than every run of one point."""
    bench = StepBench(engine)
    points = [(bench.prefill, (p,)) for p in grid.prefill] + [(bench.decode, p) for p in grid.decode]
    points += [(bench.mixed, p) for p in grid.mixed]
    runs = []
    for i in range(1 + repeats):
        started = time.perf_counter()
        runs.append([step for run, args in points for step in run(*args)])
        log(f"  pass {i + 1}/{1 + repeats}{' (warm-up)' if i == 0 else ''}: {time.perf_counter() - started:.1f} s")
    return median_steps(runs[1:] if repeats else runs)


def median_steps(runs: list[list[StepSample]]) -> list[StepSample]:
    """Step i of every run held the same work; its median time."""
    for run in runs[1:]:
        if [_work(s) for s in run] != [_work(s) for s in runs[0]]:
            raise RuntimeError("profile: the scheduler made different steps of the same grid point in two runs")
    return [_with_ms(step, statistics.median(run[i].ms for run in runs)) for i, step in enumerate(runs[0])]


def _work(step: StepSample) -> tuple:
    return step.chunks, step.num_decodes, step.decode_context_sum


def _with_ms(step: StepSample, ms: float) -> StepSample:
    return StepSample(step.chunks, step.num_decodes, step.decode_context_sum, ms)


# ---- the KV transfer on this host -------------------------------------------------------------------
def measure_kv_transfer(model: ModelConfig, dtype: torch.dtype, repeats: int) -> tuple[TransferModel, dict]:
    """Time the by-reference import of a prompt's KV (what a decode worker on this host does: copy
    the blocks out of the prefill worker's shared cache, `receiver.copy_blocks`) at two sizes and
    fit latency + bytes / bandwidth. The protocol's small messages (block refs, DONE, ACK) are
    not included; loadtest/RESULTS.md "KV transfer" has the whole protocol's figures."""
    from disagg.engine.kv_cache import KVCache
    from disagg.engine.layers.cpu_kernels import cpu_ops
    from disagg.kv_transfer.receiver import copy_blocks

    block, sizes = 16, (64, 1024)
    blocks = 2 * sizes[-1] // block
    layers, heads = model.num_hidden_layers, model.num_key_value_heads
    cpu = torch.device("cpu")
    src = KVCache(layers, blocks, block, heads, model.head_dim, dtype, cpu, shared=True)
    dst = KVCache(layers, blocks, block, heads, model.head_dim, dtype, cpu)
    src.tensor.normal_()
    ops = cpu_ops(cpu, "auto")
    points = []
    for tokens in sizes:
        n = tokens // block
        src_ids, dst_ids = list(range(0, 2 * n, 2)), list(range(n))  # scattered into packed, as after a prefill
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            copy_blocks(src.tensor, src_ids, dst.tensor, dst_ids, ops)
            times.append(time.perf_counter() - started)
        points.append((src.slice_bytes(layers, (0, heads), n), statistics.median(times[1:])))
    (b0, t0), (b1, t1) = points
    bandwidth = (b1 - b0) / max(t1 - t0, 1e-9)
    latency_ms = max(0.0, (t0 - b0 / bandwidth) * 1e3)
    notes = {
        "kind": "by reference (shared memory), receiver.copy_blocks only",
        "bytes_s": [[b, round(t * 1e3, 4)] for b, t in points],
    }
    return TransferModel(bandwidth, latency_ms), notes


# ---- the whole profile -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProfileRequest:
    model: str
    shapes: tuple[tuple[int, int], ...]
    threads: int
    max_prompt_len: int
    max_batch: int
    repeats: int
    quick: bool = False
    dtype: str = "auto"


def default_shapes(model: ModelConfig, cores: int) -> list[tuple[int, int]]:
    """Every TP x PP that fits the cores and splits the model evenly."""
    return [
        (tp, pp)
        for tp in range(1, cores + 1)
        for pp in range(1, cores // tp + 1)
        if model.num_attention_heads % tp == 0 and model.num_key_value_heads % tp == 0
        if model.num_hidden_layers % pp == 0
    ]


def run_profile(req: ProfileRequest, log: Callable[[str], None] = print) -> Profile:
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    torch.set_num_threads(req.threads)
    source = load_model_source(req.model, cache_dir=EngineConfig().cache_dir)
    grid = make_grid(req.max_prompt_len, req.max_batch, req.quick)
    config = engine_config(req, grid)
    entries: dict[tuple[int, int], StepModel] = {}
    report: dict = {"shapes": {}}
    for tp, pp in req.shapes:
        log(f"{shape_key(tp, pp)}: measuring {grid.size} grid points")
        shape_started = time.perf_counter()
        with instance(config, tp, pp) as engine:
            samples = measure_shape(engine, grid, req.repeats, log)
            dtype = engine.dtype
        entries[(tp, pp)], shape_report = fit_shape(samples)
        shape_report["seconds"] = round(time.perf_counter() - shape_started, 1)
        shape_report["samples"] = [s.to_dict() for s in samples]
        report["shapes"][shape_key(tp, pp)] = shape_report
    kv_transfer, kv_notes = measure_kv_transfer(source.config, dtype, req.repeats)
    report.update(_context(req, kv_notes, time.perf_counter() - started))
    # Other processes' load spoils the figures (two threads on two cores most of all): keep it with them.
    report["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return Profile(
        model=req.model,
        hardware=f"cpu-{req.threads}t",
        source="measured",
        entries=entries,
        kv_bytes_per_token=source.config.kv_bytes_per_token * torch.empty((), dtype=dtype).element_size(),
        num_layers=source.config.num_hidden_layers,
        kv_transfer=kv_transfer,
        fit=report,
    )


def engine_config(req: ProfileRequest, grid: Grid) -> EngineConfig:
    """Room for the largest grid point's KV (never preempting), and for its batch."""
    return EngineConfig(
        model=req.model,
        dtype=req.dtype,
        device="cpu",
        num_threads=req.threads,
        num_kv_blocks=grid.max_tokens_held // 16 + 64,
        block_size=16,
        max_num_batched_tokens=max(grid.max_step_tokens, 1),
        max_num_seqs=grid.max_batch + 2,
        enable_prefix_caching=False,  # random prompts never share a prefix; off makes `start` exact
    )


def _context(req: ProfileRequest, kv_notes: dict, seconds: float) -> dict:
    return {
        "threads": req.threads,
        "cpu": cpu_name(),
        "torch": torch.__version__,
        "repeats": req.repeats,
        "max_prompt_len": req.max_prompt_len,
        "max_batch": req.max_batch,
        "quick": req.quick,
        "kv_transfer": kv_notes,
        "seconds": round(seconds, 1),
        "notes": "ranks of a TP x PP shape ran as threads of one process (real gloo groups)",
    }


def cpu_name() -> str:
    """The CPU model and its widest vector unit: figures differ by 2x between AVX2 and AVX-512 hosts."""
    name, flags = platform.processor() or "cpu", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    vector = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    return f"{name} ({vector}, {os.cpu_count()} cpus)"


# ---- command line ----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file, HF directory, random:<shape> or the default")
    parser.add_argument("--tp-pp", default=None, help="shapes as TPxPP, e.g. 1x1,2x1,1x2 (default: all that fit)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--max-prompt-len", type=int, default=None, help="longest prompt (1024; quick: 128)")
    parser.add_argument("--max-batch", type=int, default=None, help="largest decode batch (32; quick: 8)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per grid point (3; quick: 1)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--quick", action="store_true", help="a small grid: a smoke test, not a profile to plan with")
    parser.add_argument("-o", "--output", required=True, help="profile file to write (JSON)")


def main(args: argparse.Namespace) -> int:
    try:
        req = _request(args)
    except ValueError as exc:
        print(f"disagg profile: {exc}", file=sys.stderr)
        return 2
    profile = run_profile(req, log=lambda line: print(line, file=sys.stderr))
    profile.save(args.output)
    print(error_table(profile))
    print(f"wrote {args.output} ({profile.fit['seconds']} s)")
    return 0


def _request(args: argparse.Namespace) -> ProfileRequest:
    if args.threads < 1:
        raise ValueError("--threads must be >= 1")
    source = load_model_source(args.model, cache_dir=EngineConfig().cache_dir)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    shapes = parse_shapes(args.tp_pp) if args.tp_pp else default_shapes(source.config, cores)
    quick = args.quick
    return ProfileRequest(
        model=args.model,
        shapes=tuple(shapes),
        threads=args.threads,
        max_prompt_len=args.max_prompt_len or (128 if quick else 1024),
        max_batch=args.max_batch or (8 if quick else 32),
        repeats=args.repeats or (1 if quick else 3),
        quick=quick,
        dtype=args.dtype,
    )


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        tp, _, pp = part.strip().lower().partition("x")
        if not (tp.isdigit() and pp.isdigit()) or int(tp) < 1 or int(pp) < 1:
            raise ValueError(f"--tp-pp: {part!r} is not TPxPP like 2x1")
        shapes.append((int(tp), int(pp)))
    return shapes


def error_table(profile: Profile) -> str:
    """Held-out median absolute errors, one row per shape."""
    lines = [f"{'shape':<8} {'prefill %':>9} {'decode %':>9} {'mixed sum %':>11} {'mixed fit %':>11}  chosen"]
    for key, entry in profile.fit["shapes"].items():
        mixed = entry["mixed"]
        lines.append(
            f"{key:<8} {entry['prefill']['median_abs_error_pct']:>9.1f} {entry['decode']['median_abs_error_pct']:>9.1f}"
            f" {_pct(mixed.get('sum')):>11} {_pct(mixed.get('fit')):>11}  {mixed['chosen']}"
        )
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":  # until `disagg profile` is wired into the CLI
    cli = argparse.ArgumentParser(prog="disagg profile", description=__doc__.splitlines()[0])
    add_arguments(cli)
    sys.exit(main(cli.parse_args()))
