"""A worker whose weights, KV cache and activations exceed what its device leaves it is refused at
start, with the figures, before it allocates anything (disagg/engine/memory_fit.py); one that fits
starts, and the figures the rule counts are the ones the engine allocates."""

from __future__ import annotations

import pytest
import torch

from disagg.config import EngineConfig, GiB, ParallelConfig, ServingConfig
from disagg.engine import device_memory
from disagg.engine.device_memory import available_memory, gpu_budget, host_available_bytes
from disagg.engine.engine import LLMEngine
from disagg.engine.memory_fit import fit_error, memory_need, rank_weight_params
from disagg.engine.model_shapes import named_shapes
from disagg.errors import ModelLoadError
from disagg.planner.hardware import hardware_spec
from disagg.planner.memory import config_fit_errors
from disagg.planner.models import model_spec

LLAMA3_8B = named_shapes()["llama3-8b"]


def test_a_kv_cache_larger_than_the_hosts_memory_is_refused_before_anything_is_allocated(monkeypatch):
    def never(*args):
        raise AssertionError("the model was built: the check came after an allocation")

    monkeypatch.setattr(LLMEngine, "_build_model", never)
    too_much = int(host_available_bytes() * 2)
    with pytest.raises(ModelLoadError) as refused:
        LLMEngine(EngineConfig(model="random:tiny", device="cpu", kv_cache_memory_bytes=too_much))
    message = str(refused.value)
    assert "this host's available memory" in message and "of KV cache" in message, message
    assert f"{too_much / GiB:.2f} GiB of KV cache" in message and "set kv_cache_memory_bytes to at most" in message


def test_too_many_kv_blocks_are_refused_too(monkeypatch):
    config = EngineConfig(model="random:tiny", device="cpu")
    blocks = int(host_available_bytes() // memory_need(named_shapes()["tiny"], config, "cpu").kv_block_bytes) + 1
    with pytest.raises(ModelLoadError, match="num_kv_blocks to at most"):
        LLMEngine(config.replace(num_kv_blocks=blocks))


def test_a_worker_that_fits_starts_with_the_kv_cache_and_weights_the_rule_counted():
    config = EngineConfig(model="random:tiny", device="cpu", kv_cache_memory_bytes=1 << 20)
    engine = LLMEngine(config)
    need = memory_need(engine.model_config, config, "cpu")
    assert engine.kv_cache.tensor.nbytes == need.kv_bytes == 1 << 20
    params = sum(p.numel() for p in engine.model.parameters())
    assert need.weight_bytes == params * 4  # float32, untied weights: every tensor the model holds


@pytest.mark.parametrize("name", ["llama3-8b", "smollm2-135m", "qwen2-7b"])
def test_a_ranks_weights_over_its_stages_add_up_to_the_model_with_the_vocabulary_replicated(name):
    model = named_shapes()[name]
    whole = rank_weight_params(model, 1, 1)
    stages = sum(rank_weight_params(model, 1, 4, rank) for rank in range(4))
    tied_copy = model.vocab_size * model.hidden_size if model.tie_word_embeddings else 0
    assert stages == whole + tied_copy  # a tied head's last stage holds its own copy of the table
    whole_ones = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2) + model.hidden_size
    assert rank_weight_params(model, 2, 1) == (whole - whole_ones) // 2 + whole_ones  # TP splits the layers only


def test_quantized_weights_count_at_their_packed_size():
    config = EngineConfig(model="random:llama3-8b", weights="auto")
    dense = memory_need(LLAMA3_8B, config, "cpu").weight_bytes  # float32 on a CPU
    assert memory_need(LLAMA3_8B, config.replace(weights="int8"), "cpu").weight_bytes == dense // 4
    assert memory_need(LLAMA3_8B, config, "cpu", from_gguf=True).weight_bytes == dense // 8
    assert memory_need(LLAMA3_8B, config, "cuda").weight_bytes == dense // 2  # bfloat16 on a GPU


def test_the_message_gives_the_figures_and_what_to_change():
    need = memory_need(LLAMA3_8B, EngineConfig(kv_cache_memory_bytes=32 * GiB, weights="auto"), "cuda")
    error = fit_error(need, 44.7 * GiB, "cuda:0")
    assert "14.96 GiB of weights + 32.00 GiB of KV cache" in error and "cuda:0 has 44.70 GiB" in error, error
    assert "kv_cache_memory_bytes to at most" in error
    assert "weights alone do not fit" in fit_error(need, 10 * GiB, "cuda:0")
    assert fit_error(need, need.total, "cuda:0") == ""


def test_a_gpu_worker_may_take_what_is_free_and_at_most_its_share(monkeypatch):
    assert gpu_budget(free=100, total=141, utilization=None) == 100
    assert gpu_budget(free=100, total=141, utilization=0.5) == 70.5  # the other worker may not have started
    assert gpu_budget(free=50, total=141, utilization=0.5) == 50  # or may have
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (120 * GiB, 140 * GiB))
    available, where = available_memory(torch.device("cuda:0"), 0.5)
    assert available == 70 * GiB and "cuda:0 (120.00 GiB free of 140.00 GiB" in where and "share 0.5" in where


def test_a_cgroup_limit_bounds_the_hosts_memory(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text(f"{3 * GiB}\n")
    (tmp_path / "memory.current").write_text(f"{1 * GiB}\n")
    monkeypatch.setattr(device_memory, "CGROUP_DIR", str(tmp_path))
    assert host_available_bytes() == min(2 * GiB, device_memory._meminfo_available())
    (tmp_path / "memory.max").write_text("max\n")
    assert host_available_bytes() == device_memory._meminfo_available()


def test_a_worker_given_part_of_a_gpu_may_take_that_part_of_its_memory():
    config = ServingConfig.from_dict(
        {
            "prefill": {"num_gpus_per_worker": 0.5},
            "decode": {"num_gpus_per_worker": 0.25, "engine": {"gpu_memory_utilization": 0.4}},
            "colocated": {"num_gpus_per_worker": 1},
        }
    )
    assert config.pool_engine_config(config.prefill).gpu_memory_utilization == 0.5
    assert config.pool_engine_config(config.decode).gpu_memory_utilization == 0.4  # said outright: it wins
    assert config.pool_engine_config(config.colocated).gpu_memory_utilization is None  # a whole GPU: what is free
    for bad in (0, 1.5, True, "half"):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)


def test_the_planner_refuses_by_the_same_rule_per_worker_and_stage():
    config = ServingConfig.from_dict(
        {
            "engine": {"model": "random:llama3-8b", "kv_cache_memory_bytes": 32 * GiB, "weights": "auto"},
            "prefill": {"tensor_parallel_size": 2, "num_gpus_per_worker": 1},
            "decode": {"num_instances": 2, "num_gpus_per_worker": 1},
        }
    )
    l40s = hardware_spec("l40s")
    errors = config_fit_errors(config, model_spec("llama3-8b"), {"prefill": l40s, "decode": l40s})
    assert [e.split(":")[0] for e in errors] == [
        "prefill instance 0 (stage 0)",
        "decode instance 0 (stage 0)",
        "decode instance 1 (stage 0)",
    ]
    assert "14.96 GiB of weights + 32.00 GiB of KV cache" in errors[1] and "40.23 GiB" in errors[1], errors[1]
    engine = config.pool_engine_config(config.decode)
    need = memory_need(model_spec("llama3-8b"), engine, "cuda")
    pp = ParallelConfig(1, 2)
    stage_need = memory_need(model_spec("llama3-8b"), engine.replace(parallel=pp), "cuda", pp_rank=1)
    assert stage_need.kv_bytes == need.kv_bytes  # the same budget, half the layers: twice the blocks
    assert stage_need.weight_bytes < need.weight_bytes
