"""FP8 weights (layers/fp8.py, weights: fp8): the per-channel and per-token quantization, both
products (torch._scaled_mm, which torch's CPU build also runs, and the dequantized fallback)
against float64 on the same quantized values, a model's GEMMs converted, and the refusals:
fp8 off CUDA, int8 and int4 on CUDA. The GPU's throughput and greedy agreement: tests/gpu."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg import LLM, SamplingParams
from disagg.config import EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.engine.layers.fp8 import (
    FP8_DTYPE,
    _scaled_mm_fails,
    FP8_MAX,
    Fp8Weight,
    dequantize_rows,
    describe,
    quantize_rows,
    scaled_mm_unavailable,
)
from disagg.engine.memory_fit import weight_bytes_per_param
from disagg.errors import InvalidRequestError

E4M3_STEP = 2**-3  # e4m3's relative spacing: 3 mantissa bits


def _random(shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 4).to(dtype)


# ---- the quantization --------------------------------------------------------------------------------
def test_each_row_round_trips_within_e4m3s_rounding():
    w = _random((24, 80), seed=1)
    q, scales = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and scales.shape == (24, 1) and scales.dtype == torch.float32
    back = dequantize_rows(q, scales)
    # half a step of the value's own binade, or of the smallest normal's (subnormals) at the row's scale
    bound = torch.maximum(w.abs() * E4M3_STEP / 2, scales * 2**-9)
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    # each row's largest magnitude maps to e4m3's largest value, exactly
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((24,), FP8_MAX))


def test_a_row_of_zeros_stays_zero():
    w = _random((3, 32), seed=2)
    w[1] = 0
    q, scales = quantize_rows(w)
    assert scales[1].item() > 0 and torch.equal(dequantize_rows(q, scales)[1], torch.zeros(32))
    assert torch.isfinite(q.float()).all()


# ---- the products ------------------------------------------------------------------------------------
def _reference(x: torch.Tensor, weight: Fp8Weight, quantized_rows: bool) -> torch.Tensor:
    """float64 product of the values each path multiplies."""
    rows = dequantize_rows(*quantize_rows(x)) if quantized_rows else x.float()
    return rows.double() @ weight.dequantized().double().t()


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_scaled_mm_applies_the_token_and_channel_scales(rows):
    """torch._scaled_mm with row-wise scales (as on a GPU; torch's CPU build runs it too) gives
    the product of the quantized rows and the quantized weight, rounded once to bfloat16."""
    w = _random((48, 64), seed=3, dtype=torch.bfloat16)
    x = _random((rows, 64), seed=4, dtype=torch.bfloat16)
    fp8 = Fp8Weight(w, use_scaled_mm=True)
    got = fp8.linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    expected = _reference(x, fp8, quantized_rows=True)
    torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=1e-3 * expected.abs().max().item())


def test_the_fallback_multiplies_the_dequantized_weight_and_keeps_the_shape_and_bias():
    w = _random((40, 24), seed=5)
    x = _random((6, 24), seed=6).view(2, 3, 24)
    bias = torch.randn(40)
    fp8 = Fp8Weight(w, use_scaled_mm=False)
    got = fp8.linear(x, None, bias)
    assert got.shape == (2, 3, 40)
    expected = _reference(x.reshape(6, 24), fp8, quantized_rows=False).float().view(2, 3, 40) + bias
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fp8_is_close_to_the_dense_product():
    """What the format costs, relative to the dense product: about 2.5% with the weight alone
    in FP8, 3.5% with the rows too (e4m3's 3 mantissa bits)."""
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(64, 128, generator=gen), torch.randn(8, 128, generator=gen)
    dense = F.linear(x, w)
    for use_scaled_mm in (True, False):
        got = Fp8Weight(w, use_scaled_mm=use_scaled_mm).linear(x)
        assert (got - dense).norm() < 0.05 * dense.norm()


def test_where_scaled_mm_does_not_apply_it_says_why():
    fp8 = Fp8Weight(torch.randn(32, 32))
    assert not fp8.use_scaled_mm and fp8.fallback_reason == "cpu has no FP8 GEMM"
    assert scaled_mm_unavailable(torch.randn(32, 32), torch.bfloat16) == "cpu has no FP8 GEMM"
    assert _scaled_mm_fails(torch.device("cpu")) is None  # the probe's call is one torch takes
    line = describe([fp8, Fp8Weight(torch.randn(16, 16), use_scaled_mm=True)])
    assert line.startswith("weights: fp8: 1 of 2 GEMMs through torch._scaled_mm") and "cpu has no FP8 GEMM" in line
    assert fp8.nbytes() == 32 * 32 + 32 * 4  # a byte a weight, a float32 scale a channel


def test_fp8_counts_a_byte_a_weight_in_the_memory_fit():
    assert weight_bytes_per_param("fp8", 2, "cuda", from_gguf=False) == 1.0


# ---- a model ------------------------------------------------------------------------------------------
def _first_tokens(llm: LLM, prompts: list[list[int]]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [out.outputs[0].token_ids[0] for out in outputs]


def test_a_models_gemms_converted_to_fp8_predict_as_dense(tiny_qwen2_bias_dir):
    """Every linear layer (QKV with its bias, output, MLP) takes its FP8 weight, the vocabulary
    projection stays dense, and most prompts' next tokens are the dense model's (a random tiny
    model has near-ties). On CPU the engine refuses fp8 (below), so the conversion is called
    directly (its products: the fallback)."""
    prompts = [[3 + i, 17 + 5 * i, 40 + 2 * i, 9, 100 + 7 * i] for i in range(16)]
    llm = LLM(model=tiny_qwen2_bias_dir, dtype="float32", num_kv_blocks=64)
    dense = _first_tokens(llm, prompts)
    line = llm.engine.model.fp8_weights()
    gemms = [m.packed for m in llm.engine.model.modules() if hasattr(m, "packed")]
    assert gemms and all(isinstance(g, Fp8Weight) for g in gemms)
    assert f"0 of {len(gemms)} GEMMs" in line and "cpu has no FP8 GEMM" in line
    fp8 = _first_tokens(llm, prompts)
    assert sum(a == b for a, b in zip(dense, fp8, strict=True)) >= 12, (dense, fp8)


# ---- the refusals -------------------------------------------------------------------------------------
def test_fp8_is_refused_on_cpu_and_int_formats_on_cuda_at_config():
    with pytest.raises(InvalidRequestError, match="weights: fp8 runs on cuda only .*int8, int4 or auto"):
        EngineConfig(model="m", device="cpu", weights="fp8")
    for fmt in ("int8", "int4"):
        with pytest.raises(ValueError, match=f"weights: {fmt} runs on cpu only .*fp8 \\(Hopper or Ada\\)"):
            EngineConfig(model="m", device="cuda:1", weights=fmt)
    EngineConfig(model="m", device="cuda", weights="fp8")  # where each has its kernels
    EngineConfig(model="m", device="cpu", weights="int4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the device `auto` resolves to without CUDA")
def test_fp8_is_refused_by_the_engine_when_auto_resolves_to_cpu():
    """Before anything is read: the model named here does not exist."""
    with pytest.raises(ValueError, match="weights: fp8 runs on cuda only"):
        LLMEngine(EngineConfig(model="/nonexistent/model", device="auto", weights="fp8"))
