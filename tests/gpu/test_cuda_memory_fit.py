"""On a GPU, a worker whose weights and KV cache exceed what the device has free, or its share of
the device (gpu_memory_utilization), is refused before it allocates anything; one that fits its
share starts (disagg/engine/memory_fit.py, device_memory.py)."""

from __future__ import annotations

import pytest
import torch

from disagg.config import GiB, EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.errors import ModelLoadError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_kv_cache_larger_than_the_gpu_is_refused_with_its_figures(monkeypatch):
    monkeypatch.setattr(LLMEngine, "_build_model", lambda *a: pytest.fail("allocated before the check"))
    free, total = torch.cuda.mem_get_info()
    config = EngineConfig(model="random:tiny", device="cuda", weights="auto", kv_cache_memory_bytes=int(total * 2))
    with pytest.raises(ModelLoadError, match=f"{total / GiB:.2f} GiB") as refused:
        LLMEngine(config)
    assert "cuda" in str(refused.value) and "kv_cache_memory_bytes to at most" in str(refused.value)


def test_a_worker_sharing_the_gpu_is_held_to_its_share():
    """Llama-3-8B's 15 GiB of bfloat16 weights do not fit in a twentieth of any GPU this project
    targets (7 GiB of an H200): refused, while the device itself has room."""
    config = EngineConfig(model="random:llama3-8b", device="cuda", dtype="bfloat16", weights="auto", num_kv_blocks=16)
    with pytest.raises(ModelLoadError, match="share 0.05"):
        LLMEngine(config.replace(gpu_memory_utilization=0.05))


def test_a_worker_that_fits_its_share_starts():
    config = EngineConfig(model="random:tiny", device="cuda", weights="auto", kv_cache_memory_bytes=64 << 20)
    engine = LLMEngine(config.replace(gpu_memory_utilization=0.5))
    assert engine.kv_cache.tensor.nbytes == 64 << 20 and engine.kv_cache.tensor.is_cuda
