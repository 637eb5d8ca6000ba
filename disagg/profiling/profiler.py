"""`disagg profile`: time the real engine's steps over a grid and fit the latency model to them.

For each TP x PP the engine runs as in a TP x PP instance, but in one process: one thread per
rank, real gloo groups, rank 0 scheduling (on CUDA, 1x1 only: see `device.check_device`). Every
timed step is a whole `LLMEngine.step()` (schedule, forward, sample, outputs); what the step held
is the engine's own record of it (`disagg.step_work.StepWork`, as its step reports carry it), so it
is recorded exactly as the router learns from it and as a simulator driving the same `Scheduler`
describes it. Each grid point is run once to warm up (oneDNN and CUDA build kernels
per shape on first use), then `repeats` times; its median is kept. The fit and its held-out
errors are in `fit`; the command line in `cli`.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from disagg.config import EngineConfig, ParallelConfig
from disagg.engine.distributed import RankPlace, join_instance
from disagg.engine.engine import LLMEngine
from disagg.engine.loader import load_model_source
from disagg.engine.model_config import ModelConfig
from disagg.engine.step_chunks import portable
from disagg.placement.latency_model import StepModel, TransferModel
from disagg.placement.profile import Profile, shape_key
from disagg.profiling.device import check_device, device_clock, hardware_name
from disagg.profiling.fit import fit_shape, sample_entry
from disagg.profiling.grid import Grid, make_grid
from disagg.request import Request, SamplingParams
from disagg.step_work import MeasuredStep

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
    store = dist.HashStore()  # the ranks are threads of this process: nothing listens
    followers = ThreadRanks(tp * pp - 1)

    def build(rank: int) -> LLMEngine:
        place = RankPlace.of_rank(rank, tp, pp)
        groups = join_instance(place, store, torch.device("cpu"), "127.0.0.1")
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
        # The grid says where prompts are chunked (each step's budget, timed_step): no fair
        # prefill caps, by tokens or by work, in between.
        engine.scheduler.long_prefill_token_threshold = 0
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self._ids = iter(range(1 << 62))
        self._clock = device_clock(engine.device)

    # ---- one run of a grid point: its steps, the engine left empty ----------------------------
    def prefill(self, lengths: tuple[int, ...]) -> list[MeasuredStep]:
        """One step of whole prompts (and nothing else)."""
        for n in lengths:
            self._add_prompt(n)
        return self._cleared([self.timed_step(sum(lengths))])

    def decode(self, batch: int, context: int) -> list[MeasuredStep]:
        """Decode steps of `batch` requests with contexts around `context`: the median step."""
        self._import_decodes(batch, context)
        for _ in range(DECODE_WARM_UP_STEPS):
            self.timed_step(batch)
        steps = [self.timed_step(batch) for _ in range(DECODE_TIMED_STEPS)]
        middle = steps[len(steps) // 2]  # contexts grow a token a step: the middle one is the median's
        return self._cleared([middle.with_ms(statistics.median(s.ms for s in steps))])

    def mixed(self, decodes: int, context: int, start: int, num_tokens: int) -> list[MeasuredStep]:
        """`decodes` running plus a prompt chunk of `num_tokens` after `start` computed ones; with
        start > 0 the step that computes the first `start` tokens (with the decodes) comes first."""
        self._import_decodes(decodes, context)
        self._add_prompt(start + num_tokens)
        first = [self.timed_step(decodes + start)] if start else []
        return self._cleared(first + [self.timed_step(decodes + num_tokens)])

    def timed_step(self, budget: int) -> MeasuredStep:
        """One whole engine step under a token budget of `budget`: what it held and how long it took."""
        scheduler = self.engine.scheduler
        # The profiler sets each step's token budget itself, so that the scheduler chunks prompts
        # where the grid wants them chunked.
        scheduler.max_num_batched_tokens = budget
        before = [(r, r.num_computed_tokens) for r in (*scheduler.running, *scheduler.waiting)]
        steps_before = self.engine.num_steps
        started = self._clock()
        self.engine.step()
        ms = (self._clock() - started) * 1e3
        if self.engine.num_steps == steps_before:
            raise RuntimeError("profile: a grid point's step computed nothing")
        if any(r.num_computed_tokens < computed for r, computed in before):
            raise RuntimeError("profile: a request was preempted; the KV cache is too small for the grid")
        return MeasuredStep(self.engine.step_stats[-1].work, ms)

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

    def _cleared(self, steps: list[MeasuredStep]) -> list[MeasuredStep]:
        self._clear()
        return steps

    def _clear(self) -> None:
        for rid in list(self.engine.scheduler.requests):
            self.engine.abort_request(rid)
        if self.engine.num_free_blocks != self.engine.num_total_blocks:
            raise RuntimeError("profile: blocks still held after every request ended")


def measure_shape(engine: LLMEngine, grid: Grid, repeats: int, log: Callable[[str], None]) -> list[MeasuredStep]:
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


def median_steps(runs: list[list[MeasuredStep]]) -> list[MeasuredStep]:
    """Step i of every run held the same work; its median time."""
    for run in runs[1:]:
        if [s.work for s in run] != [s.work for s in runs[0]]:
            raise RuntimeError("profile: the scheduler made different steps of the same grid point in two runs")
    return [step.with_ms(statistics.median(run[i].ms for run in runs)) for i, step in enumerate(runs[0])]


# ---- the KV transfer on this host -------------------------------------------------------------------
def measure_kv_transfer(
    model: ModelConfig, dtype: torch.dtype, repeats: int, device: torch.device
) -> tuple[TransferModel, dict]:
    """Time the by-reference import of a prompt's KV (what a decode worker on this host does: copy
    the blocks out of the prefill worker's shared cache, `receiver.copy_blocks`) at two sizes and
    fit latency + bytes / bandwidth. The protocol's small messages (block refs, DONE, ACK) are
    not included; loadtest/RESULTS.md "KV transfer" has the whole protocol's figures. On a GPU
    the same copy runs within the device: a bound on a transfer, not a link between devices."""
    from disagg.engine.kv_cache import KVCache
    from disagg.engine.layers.cpu_kernels import cpu_ops
    from disagg.kv_transfer.receiver import copy_blocks

    block, sizes = 16, (64, 1024)
    blocks = 2 * sizes[-1] // block
    layers, heads = model.num_hidden_layers, model.num_key_value_heads
    src = KVCache(layers, blocks, block, heads, model.head_dim, dtype, device, shared=True)
    dst = KVCache(layers, blocks, block, heads, model.head_dim, dtype, device)
    src.tensor.normal_()
    ops, clock = cpu_ops(device, "auto"), device_clock(device)
    points = []
    for tokens in sizes:
        n = tokens // block
        src_ids, dst_ids = list(range(0, 2 * n, 2)), list(range(n))  # scattered into packed, as after a prefill
        times = []
        for _ in range(repeats + 1):
            started = clock()
            copy_blocks(src.tensor, src_ids, dst.tensor, dst_ids, ops)
            times.append(clock() - started)
        points.append((src.slice_bytes(layers, (0, heads), n), statistics.median(times[1:])))
    (b0, t0), (b1, t1) = points
    bandwidth = (b1 - b0) / max(t1 - t0, 1e-9)
    latency_ms = max(0.0, (t0 - b0 / bandwidth) * 1e3)
    where = "by reference (shared memory)" if device.type == "cpu" else f"within one device ({device})"
    notes = {
        "kind": f"{where}, receiver.copy_blocks only",
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
    device: str = "cpu"  # or "cuda" / "cuda:N" (1x1 shapes only: device.check_device)


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
    check_device(req.device, list(req.shapes))
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
        shape_report["samples"] = [sample_entry(s) for s in samples]
        report["shapes"][shape_key(tp, pp)] = shape_report
    kv_transfer, kv_notes = measure_kv_transfer(source.config, dtype, req.repeats, torch.device(req.device))
    report.update(_context(req, kv_notes, time.perf_counter() - started))
    # Other processes' load spoils the figures (two threads on two cores most of all): keep it with them.
    report["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return Profile(
        model=req.model,
        hardware=hardware_name(req.device, req.threads),
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
        device=req.device,
        num_threads=req.threads,
        num_kv_blocks=grid.max_tokens_held // 16 + 64,
        block_size=16,
        max_num_batched_tokens=max(grid.max_step_tokens, 1),
        max_num_seqs=grid.max_batch + 2,
        enable_prefix_caching=False,  # random prompts never share a prefix: nothing to look up
    )


def _context(req: ProfileRequest, kv_notes: dict, seconds: float) -> dict:
    return {
        "threads": req.threads,
        "device": req.device,
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
