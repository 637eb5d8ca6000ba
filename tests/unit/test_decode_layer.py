"""EngineConfig.fused_layer: a decode-only CPU step runs each Llama-family layer as one C++ call
(layers/decode_layer.py), which must give the op-by-op path's numbers bit for bit (so greedy
text, logprobs and the KV cache are unchanged, in any batch), and must not take a layer or a step
it does not compute."""

from __future__ import annotations

import pytest
import torch
from support import random_prompts

from disagg import LLM, SamplingParams
from disagg.engine.layers.cpu_kernels import cpu_ops
from disagg.engine.layers.decode_layer import FusedDecodeLayer

GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(autouse=True)
def _kernels():
    if cpu_ops(torch.device("cpu"), "auto") is None:
        pytest.skip("the C++ CPU kernels did not build here")


def _run(model_dir: str, fused: bool, weights: str, prompts, max_tokens: int = 12):
    llm = LLM(model=model_dir, weights=weights, num_kv_blocks=128, fused_layer=fused)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    return llm, outs


def _fused_layers(llm) -> int:
    return sum(isinstance(layer._fused, FusedDecodeLayer) for layer in llm.engine.model.layers)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_fused_layers_give_the_unfused_tokens_logprobs_and_cache(tiny_gqa_dir, weights):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 17, 9], 256, seed=3)]
    fused, fused_outs = _run(tiny_gqa_dir, True, weights, prompts)
    plain, plain_outs = _run(tiny_gqa_dir, False, weights, prompts)
    assert _fused_layers(fused) == len(fused.engine.model.layers) and _fused_layers(plain) == 0
    for a, b in zip(fused_outs, plain_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # bit for bit, not merely close
    assert torch.equal(fused.engine.kv_cache.tensor, plain.engine.kv_cache.tensor)


def test_a_sliding_window_attends_as_unfused(family_dir):
    """Mistral's window (32 positions) binds past the prompts' ends: the op passes it on."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([28, 40], 256, seed=7)]
    fused, fused_outs = _run(family_dir("mistral"), True, "int4", prompts)
    _, plain_outs = _run(family_dir("mistral"), False, "int4", prompts)
    assert _fused_layers(fused) == len(fused.engine.model.layers)
    assert [o.outputs[0].logprobs for o in fused_outs] == [o.outputs[0].logprobs for o in plain_outs]


def test_a_stream_alone_and_among_others_is_unchanged(tiny_llama_dir):
    """A decode row's numbers do not depend on how many rows its fused step holds."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 30, 12, 3], 256, seed=5)]
    _, together = _run(tiny_llama_dir, True, "int4", prompts)
    _, alone = _run(tiny_llama_dir, True, "int4", prompts[:1])
    assert together[0].outputs[0].logprobs == alone[0].outputs[0].logprobs


def test_layers_it_does_not_compute_keep_their_path(tiny_qwen2_bias_dir, tiny_llama_dir):
    llm, _ = _run(tiny_qwen2_bias_dir, True, "int4", [{"prompt_token_ids": [5, 6, 7]}], max_tokens=3)
    assert _fused_layers(llm) == 0  # QKV bias: not the op's
    dense, _ = _run(tiny_llama_dir, True, "fp32", [{"prompt_token_ids": [5, 6, 7]}], max_tokens=3)
    assert _fused_layers(dense) == 0  # float weights: not on the quantized kernels
