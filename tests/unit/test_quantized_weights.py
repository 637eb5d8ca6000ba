"""Weights kept quantized: each GGUF format the engine keeps (Q4_0, Q4_1 as int4; Q8_0 as int8)
against gguf's own dequantized reference on random blocks, the format chosen per weight, and
the default model served with its weights quantized."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disagg import LLM, SamplingParams
from disagg.engine.layers.quantized import Int4Weight, Int8Weight, quantize, weight_format
from disagg.engine.models.llama import QuantizedEmbedding

OUT, IN = 96, 256


def _gguf_roundtrip(weight: torch.Tensor, type_name: str) -> torch.Tensor:
    """The weight as a GGUF file of `type_name` stores it: quantized by gguf, dequantized back."""
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    blocks = gguf.quants.quantize(weight.numpy().astype(np.float32), kind)
    return torch.from_numpy(gguf.quants.dequantize(blocks, kind)).reshape(weight.shape)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("type_name, fmt", [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8")])
def test_a_gguf_format_kept_quantized_computes_what_its_dequantized_weights_do(type_name, fmt):
    torch.manual_seed(0)
    reference = _gguf_roundtrip(torch.randn(OUT, IN) * 0.05, type_name)
    kept = quantize(reference, fmt, [type_name])
    x = torch.randn(5, IN)
    # bfloat16 activations and scales: ~0.4% each; a dense float32 GEMM is the reference.
    assert _relative_error(kept.linear(x), x @ reference.T) < 0.02
    if fmt == "int4":  # 4-bit blocks are kept at their own values, up to the scales' bfloat16
        assert _relative_error(kept.dequantized(), reference) < 0.01


def test_int4_is_far_closer_to_q4_blocks_than_to_arbitrary_weights():
    """The int4 groups are GGUF's blocks: on Q4_1 values the only error left is rounding."""
    torch.manual_seed(1)
    dense = torch.randn(OUT, IN)
    on_blocks = _relative_error(
        Int4Weight(_gguf_roundtrip(dense, "Q4_1")).dequantized(), _gguf_roundtrip(dense, "Q4_1")
    )
    on_dense = _relative_error(Int4Weight(dense).dequantized(), dense)
    assert on_blocks < on_dense / 5, (on_blocks, on_dense)


def test_int8_per_row_and_the_embedding_s_int8_blocks():
    weight = _gguf_roundtrip(torch.randn(50, 64) * torch.logspace(-2, 0, 64), "Q8_0")  # scales vary along a row
    vocab = Int8Weight(weight)
    assert _relative_error(vocab.dequantized(), weight) < 0.05
    assert vocab._own_bytes() < weight.numel() * weight.element_size() / 3
    ids = torch.tensor([3, 0, 49])
    assert torch.allclose(QuantizedEmbedding(weight)(ids), weight[ids], rtol=1e-6, atol=1e-7)  # Q8_0 kept exactly


@pytest.mark.parametrize(
    "setting, types, expected",
    [
        ("auto", ["Q4_1", "Q4_1", "Q4_0"], "int4"),
        ("auto", ["Q4_1", "Q6_K"], "int8"),  # a fused QKV whose parts differ: the wider
        ("auto", ["Q8_0"], "int8"),
        ("auto", ["F16"], None),
        ("auto", [None], None),  # not a GGUF
        ("fp32", ["Q4_1"], None),
        ("int4", [None], "int4"),
    ],
)
def test_the_format_of_each_weight(setting, types, expected):
    assert weight_format(setting, types) == expected


def test_a_group_that_does_not_divide_the_input_is_refused():
    with pytest.raises(ValueError, match="multiple of the group size"):
        Int4Weight(torch.randn(8, 40))


@pytest.mark.slow
def test_the_default_model_kept_quantized_answers_and_is_smaller():
    quantized = LLM(num_kv_blocks=64, weights="auto")
    dense = LLM(num_kv_blocks=64, weights="fp32")
    # (The chat answer's first token is a near-tie in float32 already, -1.88 against -1.96: 4-bit
    # noise may flip it, so the check is a continuation the model is sure of.)
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0)
    outs = [
        llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0] for llm in (quantized, dense)
    ]
    assert all(o.text.startswith(" Paris") for o in outs), [o.text for o in outs]
    first = [next(iter(o.logprobs[0].values())) for o in outs]
    assert abs(first[0] - first[1]) < 0.1, first
    layers = quantized.engine.model.layers[0]
    assert isinstance(layers.mlp.gate_up_proj.packed, Int4Weight)
    assert isinstance(quantized.engine.model.logits_weight, Int8Weight)

    def weight_bytes(llm) -> int:
        return sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())

    assert weight_bytes(quantized) < weight_bytes(dense) / 20  # dense copies freed (what is left: norms)
