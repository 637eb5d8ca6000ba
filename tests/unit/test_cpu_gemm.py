"""oneDNN prepacked linears equal F.linear, follow weight changes, and step aside where they do not apply."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from disagg.engine.layers import cpu_gemm
from disagg.engine.layers.cpu_gemm import PackedWeight
from disagg.engine.layers.linear import ColumnParallelLinear, RowParallelLinear

needs_onednn = pytest.mark.skipif(
    not cpu_gemm.onednn_enabled(), reason="oneDNN packing not available in this torch build"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_matches_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    x, weight, bias = (
        torch.randn(rows, 96, generator=gen),
        torch.randn(200, 96, generator=gen),
        torch.randn(200, generator=gen),
    )
    holder = PackedWeight()
    torch.testing.assert_close(holder.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(holder.linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(holder.linear(x.t().contiguous().t(), weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_repacks_when_the_weight_changes():
    x, weight = torch.randn(4, 32), torch.randn(16, 32)
    holder = PackedWeight()
    holder.linear(x, weight)
    with torch.no_grad():
        weight.mul_(2)  # in place: the version counter moves
    torch.testing.assert_close(holder.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    weight.data.copy_(torch.randn(16, 32))  # through .data (as checkpoint loading does): needs reset()
    holder.reset()
    torch.testing.assert_close(holder.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_falls_back_outside_cpu_float32():
    holder = PackedWeight()
    x, weight = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)
    assert torch.equal(holder.linear(x, weight), F.linear(x, weight))
    assert holder._packed is None
    off = PackedWeight("torch")
    assert not off.enabled
    x32, w32 = torch.randn(3, 8), torch.randn(5, 8)
    assert torch.equal(off.linear(x32, w32), F.linear(x32, w32))


def test_layers_keep_the_parallel_layers_contract():
    column = ColumnParallelLinear(8, {"a": 4, "b": 6}, bias=True)
    row = RowParallelLinear(10, 8)
    with torch.no_grad():
        for p in (column.weight, column.bias, row.weight):
            p.copy_(torch.randn_like(p))
    x = torch.randn(5, 8)
    torch.testing.assert_close(column(x), F.linear(x, column.weight, column.bias), rtol=1e-5, atol=1e-4)
    h = torch.randn(5, 10)
    torch.testing.assert_close(row(h), F.linear(h, row.weight), rtol=1e-5, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("kind", ["llama", "untied"])
def test_a_loaded_model_has_every_gemm_packed_before_its_first_step(request, kind):
    """Packing on first use made a server's first request 4x slower than the next ones."""
    from disagg.config import EngineConfig
    from disagg.engine.engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(model=request.getfixturevalue(f"tiny_{kind}_dir"), device="cpu", dtype="float32", num_kv_blocks=8)
    )
    gemms = engine.model.packed_gemms()
    assert (
        len(gemms) == 4 * engine.model_config.num_hidden_layers + 1
    )  # qkv, o, gate_up, down per layer, and the vocabulary
    assert all(holder.is_packed for holder, _ in gemms)
    x = torch.randn(3, engine.model_config.hidden_size)
    holder, weight = gemms[-1]
    torch.testing.assert_close(holder.linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("preset", [None, "64"])
def test_a_cpu_engine_bounds_onednn_caches_unless_the_environment_sets_them(request, monkeypatch, preset):
    """With oneDNN's 1024-entry caches a worker that met many prompt lengths grew by ~1 GB
    (loadtest/engine/onednn_cache.py)."""
    from disagg.config import EngineConfig
    from disagg.engine.engine import LLMEngine

    for name in cpu_gemm.CACHE_CAPACITY_ENV:
        if preset is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, preset)
    LLMEngine(
        EngineConfig(model=request.getfixturevalue("tiny_llama_dir"), device="cpu", dtype="float32", num_kv_blocks=8)
    )
    expected = preset or "256"  # disagg.config.ENV_VARS
    assert [os.environ.get(name) for name in cpu_gemm.CACHE_CAPACITY_ENV] == [expected, expected]


def test_the_choice_comes_from_the_config_whose_default_is_the_environment(monkeypatch):
    from disagg.config import EngineConfig

    monkeypatch.setenv("DISAGG_CPU_GEMM", "torch")
    assert EngineConfig().cpu_gemm == "torch"
    monkeypatch.delenv("DISAGG_CPU_GEMM")
    assert EngineConfig().cpu_gemm == "onednn"


def test_an_engine_takes_its_code_paths_from_its_config():
    from disagg.config import EngineConfig
    from disagg.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="random:tiny", num_kv_blocks=8, cpu_gemm="torch", attention_backend="torch"))
    assert not any(holder.enabled for holder, _ in engine.model.packed_gemms())
    assert engine.runner.decode_kernel is None
