"""bfloat16 on CPU: weights and KV cache in bf16, same answers as float32 where it matters."""

from __future__ import annotations

import torch

from disagg import LLM, SamplingParams


def test_bfloat16_engine_answers_the_default_question():
    llm = LLM(dtype="bfloat16", weights="bf16", num_kv_blocks=64)
    assert llm.engine.kv_cache.tensor.dtype is torch.bfloat16
    assert next(llm.engine.model.parameters()).dtype is torch.bfloat16
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=12),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_dtype_auto_is_float32_on_cpu():
    llm = LLM("random:tiny", num_kv_blocks=8)
    assert llm.engine.dtype is torch.float32
