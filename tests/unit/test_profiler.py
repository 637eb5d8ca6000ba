"""`disagg profile` on a tiny random model: what each timed step is recorded as, the file it writes,
and where it runs."""

from __future__ import annotations

import argparse
import json
import time

import pytest
import torch

from disagg.config import EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.engine.model_shapes import named_shapes
from disagg.placement.profile import load_profile
from disagg.profiling import cli
from disagg.profiling.device import check_device, default_device, device_clock, hardware_name
from disagg.profiling.grid import make_grid
from disagg.profiling.profiler import StepBench, default_shapes, engine_config, median_steps
from disagg.step_work import Chunk, MeasuredStep, StepWork


@pytest.fixture(scope="module")
def bench():
    config = EngineConfig(
        model="random:tiny", dtype="float32", device="cpu", num_kv_blocks=64, enable_prefix_caching=False
    )
    return StepBench(LLMEngine(config))


def test_a_decode_context_is_the_tokens_the_request_knows(bench):
    # Two requests of 10 and 20 prompt tokens, their KV in place and a first token each: the
    # next step computes token 11 and 21, attending to 11 and 21 tokens.
    bench._import_decodes(2, 20)
    step = bench.timed_step(budget=64)
    bench._clear()
    assert step.work == StepWork((), 2, 11 + 21)


def test_a_chunk_after_a_first_chunk_starts_where_that_one_ended(bench):
    first, second = bench.mixed(decodes=1, context=8, start=24, num_tokens=16)
    assert first.work.chunks == (Chunk(0, 24),) and second.work.chunks == (Chunk(24, 16),)
    # the decode (prompt 4, one token out) knows 5 tokens, then 6 a step later
    assert (first.work.num_decodes, first.work.decode_context_sum, second.work.decode_context_sum) == (1, 5, 6)
    assert first.work.kind == second.work.kind == "mixed"


def test_a_prefill_batch_is_one_step_of_whole_prompts(bench):
    (step,) = bench.prefill((5, 17, 3))
    assert sorted((c.start, c.num_tokens) for c in step.work.chunks) == [(0, 3), (0, 5), (0, 17)]
    assert step.work.kind == "prefill" and step.ms > 0
    assert bench.engine.num_free_blocks == bench.engine.num_total_blocks


def test_quick_profile_writes_a_file_that_loads(tmp_path):
    out = tmp_path / "tiny.json"
    args = argparse.Namespace(
        model="random:tiny",
        tp_pp="1x1,2x1,1x2",
        threads=1,
        device="cpu",
        max_prompt_len=None,
        max_batch=None,
        repeats=None,
        dtype="float32",
        quick=True,
        output=str(out),
    )
    assert cli.main(args) == 0
    profile = load_profile(str(out))
    assert profile.source == "measured" and profile.hardware == "cpu-1t"
    assert profile.shapes == [(1, 1), (1, 2), (2, 1)]
    tiny = named_shapes()["tiny"]
    assert profile.num_layers == tiny.num_hidden_layers
    assert profile.kv_bytes_per_token == 2 * tiny.num_hidden_layers * tiny.num_key_value_heads * tiny.head_dim * 4
    assert profile.kv_transfer.bandwidth_bytes_per_s < float("inf")
    errors = json.loads(out.read_text())["fit"]["shapes"]
    assert sorted(errors) == ["tp1-pp1", "tp1-pp2", "tp2-pp1"]
    for entry in errors.values():
        for kind in ("prefill", "decode"):
            assert entry[kind]["median_abs_error_pct"] >= 0 and entry[kind]["n_test"] >= 2
        assert entry["mixed"]["chosen"] in ("sum", "fit") and entry["mixed"][entry["mixed"]["chosen"]] >= 0


def test_default_shapes_split_heads_and_layers_evenly():
    smollm2 = named_shapes()["smollm2-135m"]  # 9 heads, 3 KV heads, 30 layers: TP 2 cannot split it
    assert default_shapes(smollm2, cores=2) == [(1, 1), (1, 2)]
    assert default_shapes(named_shapes()["tiny"], cores=2) == [(1, 1), (1, 2), (2, 1)]


def test_shapes_parse_and_bad_ones_are_refused():
    assert cli.parse_shapes("1x1, 2x1,1X2") == [(1, 1), (2, 1), (1, 2)]
    with pytest.raises(ValueError, match="TPxPP"):
        cli.parse_shapes("2")


def test_grid_fits_its_steps_in_the_budget_and_cache():
    grid = make_grid(1024, 32)
    assert grid.max_step_tokens >= max(sum(p) for p in grid.prefill)
    assert grid.max_batch == 32
    with pytest.raises(ValueError):
        make_grid(8, 32)


def test_runs_of_a_grid_that_made_different_steps_are_refused():
    one = MeasuredStep(StepWork((Chunk(0, 8),)), 1.0)
    other = MeasuredStep(StepWork((Chunk(0, 9),)), 1.0)
    assert median_steps([[one], [one.with_ms(3.0)], [one.with_ms(2.0)]])[0].ms == 2.0
    with pytest.raises(RuntimeError, match="different steps"):
        median_steps([[one], [other]])


# ---- where it runs -------------------------------------------------------------------------------
@pytest.fixture
def fake_gpu(monkeypatch):
    """torch as it looks on a machine with one H100 (nothing runs on it)."""
    synchronized = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    return synchronized


def _profile_args(**given) -> argparse.Namespace:
    values = dict(model="random:tiny", tp_pp=None, threads=1, device=None, max_prompt_len=None, max_batch=None,
                  repeats=None, dtype="auto", quick=True, output="unused.json")  # fmt: skip
    return argparse.Namespace(**{**values, **given})


def test_the_profiler_runs_on_the_gpu_when_there_is_one(fake_gpu):
    assert default_device() == "cuda"
    req = cli.profile_request(_profile_args())
    assert (req.device, req.shapes) == ("cuda", ((1, 1),))  # one process, one GPU
    assert engine_config(req, make_grid(128, 8, quick=True)).device == "cuda"
    assert hardware_name("cuda", threads=1) == "nvidia-h100-80gb-hbm3"


def test_the_profiler_runs_on_the_cpu_without_a_gpu_or_when_asked(monkeypatch, fake_gpu):
    assert cli.profile_request(_profile_args(device="cpu", tp_pp="1x1,2x1")).device == "cpu"
    assert hardware_name("cpu", threads=2) == "cpu-2t"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_device() == "cpu"
    with pytest.raises(ValueError, match="not available"):
        check_device("cuda", [(1, 1)])


def test_shapes_of_several_ranks_and_unknown_devices_are_refused_on_a_gpu(fake_gpu):
    with pytest.raises(ValueError, match="1x1 only"):
        cli.profile_request(_profile_args(device="cuda", tp_pp="1x1,2x1"))
    with pytest.raises(ValueError, match="cpu, cuda or cuda:N"):
        check_device("tpu", [(1, 1)])
    check_device("cuda:0", [(1, 1)])


def test_a_gpu_step_is_timed_after_the_device_has_finished_it(fake_gpu):
    assert device_clock(torch.device("cpu")) is time.perf_counter
    clock = device_clock(torch.device("cuda"))
    clock()
    assert fake_gpu == [torch.device("cuda")]


def test_the_error_table_prints_a_rejected_mixed_fit_as_such():
    """A mixed fit with a negative work term is stored as "rejected": the table (printed after the
    profile is written) says so instead of failing on it."""
    fit = {"prefill": {"median_abs_error_pct": 0.59}, "decode": {"median_abs_error_pct": 3.85}}
    profile = argparse.Namespace(
        fit={"shapes": {"tp1-pp1": {**fit, "mixed": {"sum": 3.46, "fit": "rejected", "chosen": "sum"}}}}
    )
    [_, row] = cli.error_table(profile).splitlines()
    assert row.split() == ["tp1-pp1", "0.6", "3.9", "3.5", "rejected", "sum"]
