"""FP8 weights on a GPU (weights: fp8, layers/fp8.py): torch._scaled_mm with row-wise scales gives
the product of the quantized values (as tests/unit/test_fp8_weights.py checks on CPU), and an
engine with FP8 weights decodes greedy tokens that mostly agree with bf16's."""

from __future__ import annotations

import pytest
import torch
from support import default_gguf_location

from disagg import LLM, SamplingParams
from disagg.config import DEFAULT_MODEL
from disagg.engine.layers.fp8 import SCALED_MM_CAPABILITY, Fp8Weight, dequantize_rows, quantize_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = torch.device("cuda")


def _has_fp8_tensor_cores() -> bool:
    return torch.cuda.get_device_capability(DEVICE) >= SCALED_MM_CAPABILITY


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_scaled_mm_on_the_gpu_multiplies_the_quantized_values(rows):
    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    w = torch.randn(256, 512, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    x = torch.randn(rows, 512, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    fp8 = Fp8Weight(w)
    assert fp8.use_scaled_mm == _has_fp8_tensor_cores(), fp8.fallback_reason
    got = fp8.linear(x)
    rows_used = dequantize_rows(*quantize_rows(x)) if fp8.use_scaled_mm else x.float()
    expected = rows_used.double() @ fp8.dequantized().double().t()
    torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=2e-3 * expected.abs().max().item())


def _first_tokens(llm: LLM, prompts: list[list[int]]) -> list[int]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=1))
    return [o.outputs[0].token_ids[0] for o in outs]


def test_an_fp8_engine_predicts_as_bf16_on_a_tiny_checkpoint(tiny_qwen2_bias_dir):
    prompts = [[3 + i, 17 + 5 * i, 40 + 2 * i, 9, 100 + 7 * i] for i in range(16)]
    bf16 = _first_tokens(LLM(model=tiny_qwen2_bias_dir, device="cuda", dtype="bfloat16", num_kv_blocks=64), prompts)
    llm = LLM(model=tiny_qwen2_bias_dir, device="cuda", dtype="bfloat16", weights="fp8", num_kv_blocks=64)
    gemms = [m.packed for m in llm.engine.model.modules() if hasattr(m, "packed")]
    assert gemms and all(isinstance(g, Fp8Weight) for g in gemms)
    fp8 = _first_tokens(llm, prompts)
    assert sum(a == b for a, b in zip(bf16, fp8, strict=True)) >= 10, (bf16, fp8)


@pytest.mark.slow
def test_fp8_agrees_with_bf16_on_the_default_model():
    """Greedy answers to chat questions: most of each answer's tokens, up to its first difference."""
    try:
        default_gguf_location()
    except RuntimeError as exc:  # not installed here (a GPU machine gets it from `make gpu-kit`)
        pytest.skip(str(exc))
    questions = ["What is the capital of France?", "Name three primary colours.", "List the planets."]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    answers = []
    for weights in ("bf16", "fp8"):
        llm = LLM(model=DEFAULT_MODEL, device="cuda", dtype="bfloat16", weights=weights)
        prompts = [llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        answers.append([list(o.outputs[0].token_ids) for o in outs])
        del llm
    shares = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) / len(x) for x, y in zip(*answers)]
    assert sum(shares) / len(shares) >= 0.3, answers
