"""Weights kept quantized: each GGUF format the engine keeps (Q4_0, Q4_1 as int4; Q8_0 as int8)
against gguf's own dequantized reference on random blocks, with our kernels (csrc/
quantized_gemv.cpp) and with torch's; the format chosen per weight; and the default model
served with its weights quantized."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disagg import LLM, SamplingParams
from disagg.engine.layers.cpu_kernels import cpu_ops
from disagg.engine.layers.quantized import Int4Weight, Int8Weight, quantize, weight_format
from disagg.engine.models.causal_lm import QuantizedEmbedding

OUT, IN = 96, 256


def _gguf_roundtrip(weight: torch.Tensor, type_name: str) -> torch.Tensor:
    """The weight as a GGUF file of `type_name` stores it: quantized by gguf, dequantized back."""
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    blocks = gguf.quants.quantize(weight.numpy().astype(np.float32), kind)
    return torch.from_numpy(gguf.quants.dequantize(blocks, kind)).reshape(weight.shape)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.fixture(params=["ours", "torch"])
def kernels(request):
    """torch.ops.disagg_cpu where our kernels are asked for (skipped where they did not build),
    None for torch's."""
    if request.param == "torch":
        return None
    ops = cpu_ops(torch.device("cpu"), "auto")
    if ops is None:
        pytest.skip("the C++ CPU kernels did not build here")
    return ops


@pytest.mark.parametrize("type_name, fmt", [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8")])
@pytest.mark.parametrize("rows", [1, 3, 5, 9])  # 5 and 9: past the few-rows path, and past our 8-row tiles
def test_a_gguf_format_kept_quantized_computes_what_its_dequantized_weights_do(type_name, fmt, rows, kernels):
    torch.manual_seed(rows)
    reference = _gguf_roundtrip(torch.randn(OUT, IN) * 0.05, type_name)
    kept = quantize(reference, fmt, [type_name], kernels)
    x = torch.randn(rows, IN)
    # int8 or bfloat16 activations: ~0.5% each; a dense float32 GEMM is the reference.
    assert _relative_error(kept.linear(x), x @ reference.T) < 0.02
    assert _relative_error(kept._narrow(x), x @ reference.T) < 0.02  # the quantized kernel itself, at any rows
    # Blocks are kept at their own values (torch's int4 rounds the scales to bfloat16; ours keeps
    # GGUF's float16 ones, and Q8_0's exactly).
    tolerance = 0.01 if kernels is None else 1e-6
    if fmt == "int4" or kernels is not None:
        assert _relative_error(kept.dequantized(), reference) < tolerance


def test_our_int4_blocks_are_gguf_s_q4_1_bytes(kernels):
    if kernels is None:
        pytest.skip("torch's int4 keeps its own packing")
    import gguf

    torch.manual_seed(2)
    raw = gguf.quants.quantize((torch.randn(OUT, IN) * 0.05).numpy(), gguf.GGMLQuantizationType.Q4_1)
    values = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)).reshape(OUT, IN)
    assert torch.equal(Int4Weight(values, kernels=kernels).blocks, torch.from_numpy(raw.view(np.uint8)).view(OUT, -1))


@pytest.mark.parametrize("rows", [1, 2, 4, 7])
def test_fused_gate_up_gives_silu_of_gate_times_up(rows, kernels):
    torch.manual_seed(3)
    gate_up = _gguf_roundtrip(torch.randn(2 * OUT, IN) * 0.05, "Q4_1")
    x = torch.randn(rows, IN)
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    got = quantize(gate_up, "int4", ["Q4_1"], kernels).silu_mul(x)
    assert _relative_error(got, torch.nn.functional.silu(gate) * up) < 0.03


def test_our_kernels_refuse_what_they_cannot_take(kernels):
    if kernels is None:
        pytest.skip("ours only")
    weight = Int4Weight(torch.randn(OUT, IN), kernels=kernels)
    with pytest.raises(RuntimeError, match="features"):
        kernels.q4_gemv(torch.randn(2, IN + 32), weight.blocks)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.q4_gemv(torch.randn(2, IN, dtype=torch.float64), weight.blocks)


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
    vocab = Int8Weight(weight)  # torch's kernel: one scale per row
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
def test_the_default_model_kept_quantized_answers_as_the_reference_and_is_smaller():
    quantized = LLM(num_kv_blocks=64, weights="auto")
    dense = LLM(num_kv_blocks=64, weights="fp32")
    # The chat answer's first token is a near-tie in float32 ("The" -1.88, "L'" -1.96), which
    # bfloat16 products or int8 activations flip: a prompt is computed in float32 (its first
    # token the reference's own), so the 4-bit model answers as the float32 one.
    chat = quantized.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    outs = [
        llm.generate([{"prompt_token_ids": chat}], params, use_tqdm=False)[0].outputs[0] for llm in (quantized, dense)
    ]
    assert outs[0].text.startswith("The capital of France is Paris"), outs[0].text
    firsts = [o.logprobs[0] for o in outs]
    assert firsts[0].keys() == firsts[1].keys(), firsts
    assert all(abs(firsts[0][t] - firsts[1][t]) < 1e-3 for t in firsts[0]), firsts
    layers = quantized.engine.model.layers[0]
    assert isinstance(layers.mlp.gate_up_proj.packed, Int4Weight)
    assert isinstance(quantized.engine.model.logits_weight, Int8Weight)
    if cpu_ops(torch.device("cpu"), "auto") is not None:  # ours: the vocabulary held once, by the embedding
        assert quantized.engine.model.logits_weight.q is quantized.engine.model.embed_tokens.q

    def weight_bytes(llm) -> int:
        return sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())

    assert weight_bytes(quantized) < weight_bytes(dense) / 20  # dense copies freed (what is left: norms)


def test_within_a_step_a_decode_row_takes_the_same_path_whatever_else_the_step_holds(kernels):
    """A seeded sample must not depend on the batch: a decode's row gives the same numbers alone
    and beside a prefill chunk, though the two paths (quantized kernel, float32 copy) differ."""
    torch.manual_seed(4)
    weight = quantize(_gguf_roundtrip(torch.randn(OUT, IN) * 0.05, "Q4_1"), "int4", ["Q4_1"], kernels)
    if weight._wide is None:
        pytest.skip("no float32 copy here (oneDNN off): one path only")
    decodes, prefill = torch.randn(2, IN), torch.randn(7, IN)
    alone = weight.linear(decodes, decode_rows=2)
    beside = weight.linear(torch.cat([decodes, prefill]), decode_rows=2)
    assert torch.equal(beside[:2], alone)
    assert torch.equal(beside[:2], weight._narrow(decodes))  # the quantized kernel
    assert torch.equal(beside[2:], weight._wide_product(prefill))  # prefill rows: the copy
    # a prefill of few rows takes the copy too, as it would beside others
    assert torch.equal(weight.linear(prefill[:3], decode_rows=0), weight._wide_product(prefill[:3]))
    if kernels is not None:  # the copy: the dequantized weights' float32 products, the reference's
        reference = prefill @ weight.dequantized().T  # (torch's own dequantizes through bfloat16)
        torch.testing.assert_close(weight._wide_product(prefill), reference, rtol=1e-5, atol=1e-5)


def test_an_engine_step_tells_every_quantized_gemm_its_decode_rows(monkeypatch):
    """The step passes its layout down to each GEMM (no thread-local): a step of one decode beside
    a prompt's chunk gives every quantized weight, the vocabulary's too, decode_rows=1."""
    from disagg.engine.layers import quantized

    llm = LLM(num_kv_blocks=64, weights="auto")
    engine = llm.engine
    engine.add_request("decoding", prompt_token_ids=list(range(5, 25)), sampling_params=SamplingParams(max_tokens=8))
    engine.step()  # its prompt: it decodes from now on
    seen = []
    linear = quantized._QuantizedGemm.linear
    monkeypatch.setattr(
        quantized._QuantizedGemm,
        "linear",
        lambda self, x, _dense=None, bias=None, decode_rows=None: (
            seen.append(decode_rows) or linear(self, x, _dense, bias, decode_rows)
        ),
    )
    engine.add_request("prompt", prompt_token_ids=list(range(30, 60)), sampling_params=SamplingParams(max_tokens=2))
    engine.step()
    assert seen and set(seen) == {1}, f"decode_rows the GEMMs saw: {sorted(set(seen), key=str)}"


def test_the_vocabulary_takes_int8_rows_for_decodes_and_exact_ones_for_prompts():
    """The vocabulary projection (no float copy): every decode row on the int8-activation kernel
    however many there are, every prompt row on the float32-activation one, each row's numbers
    the same whatever else the step samples."""
    ops = cpu_ops(torch.device("cpu"), "auto")
    if ops is None:
        pytest.skip("the C++ CPU kernels did not build here")
    torch.manual_seed(5)
    vocab = Int8Weight(_gguf_roundtrip(torch.randn(300, IN) * 0.05, "Q8_0"), kernels=ops).without_wide_copy()
    reference = vocab.dequantized()
    decodes, prompts = torch.randn(6, IN), torch.randn(3, IN)
    both = vocab.linear(torch.cat([decodes, prompts]), decode_rows=6)
    prompts_alone = vocab.linear(prompts[1:2], decode_rows=0)
    assert torch.equal(
        both[:6], ops.q8_gemv(decodes, vocab.q, vocab.scales)
    )  # 6 > QUANTIZED_MAX_ROWS: the kernel still
    torch.testing.assert_close(both[6:], prompts @ reference.T, rtol=1e-5, atol=1e-5)  # exact
    assert torch.equal(prompts_alone[0], both[7])
    int8_error = (both[:6] - decodes @ reference.T).abs().max()
    assert int8_error > 1e-4, "the decode rows' activations are rounded to int8: not the exact path"


def test_a_row_s_numbers_are_the_same_in_any_batch_size():
    """Each kernel's row, alone and among 1 .. 9 others, to the last bit (a seeded sample of a
    request must not depend on how many were decoded beside it)."""
    ops = cpu_ops(torch.device("cpu"), "auto")
    if ops is None:
        pytest.skip("the C++ CPU kernels did not build here")
    torch.manual_seed(6)
    int4 = Int4Weight(torch.randn(2 * OUT, IN) * 0.05, kernels=ops)
    int8 = Int8Weight(torch.randn(OUT, IN) * 0.05, kernels=ops)
    kernels = {
        "q4_gemv": lambda x: ops.q4_gemv(x, int4.blocks),
        "q4_gemv_silu_mul": lambda x: ops.q4_gemv_silu_mul(x, int4.blocks),
        "q8_gemv": lambda x: ops.q8_gemv(x, int8.q, int8.scales),
        "q8_gemv_exact": lambda x: ops.q8_gemv_exact(x, int8.q, int8.scales),
    }
    x = torch.randn(10, IN)
    for name, kernel in kernels.items():
        alone = kernel(x[:1])[0]
        differs = [n for n in range(2, 11) if not torch.equal(kernel(x[:n])[0], alone)]
        assert differs == [], f"{name}: row 0 differs among {differs} rows"


def test_a_decode_row_beside_prefill_rows_takes_the_fused_mlp_kernel():
    ops = cpu_ops(torch.device("cpu"), "auto")
    if ops is None:
        pytest.skip("the C++ CPU kernels did not build here")
    torch.manual_seed(7)
    gate_up = Int4Weight(torch.randn(2 * OUT, IN) * 0.05, kernels=ops)
    decode, prefill = torch.randn(1, IN), torch.randn(6, IN)
    alone = gate_up.silu_mul(decode, decode_rows=1)
    beside = gate_up.silu_mul(torch.cat([decode, prefill]), decode_rows=1)
    assert torch.equal(beside[:1], alone)
    gate, up = gate_up._wide_product(prefill).chunk(2, dim=-1)
    assert torch.equal(beside[1:], torch.nn.functional.silu(gate) * up)


def test_the_prompt_copy_is_float32_unless_prompt_precision_says_bf16():
    """On every instance, a decode one too: the prompts it recomputes must match a prefill one's."""
    from disagg.config import EngineConfig, Role
    from disagg.engine.engine import LLMEngine
    from disagg.engine.layers.quantized import wide_dtype_for

    assert wide_dtype_for() == torch.float32
    assert wide_dtype_for(prompt_precision="bf16") == torch.bfloat16  # speed over fidelity
    decode = (
        LLMEngine(EngineConfig(role=Role.DECODE, num_kv_blocks=8, weights="auto")).model.layers[0].mlp.down_proj.packed
    )
    assert decode.wide_dtype == torch.float32
    with pytest.raises(ValueError, match="prompt_precision"):
        LLM(num_kv_blocks=8, prompt_precision="fp16")
    torch.manual_seed(8)
    weight = _gguf_roundtrip(torch.randn(OUT, IN) * 0.05, "Q4_1")
    ops = cpu_ops(torch.device("cpu"), "auto")  # ours: their dequantized values are exact
    if ops is None:
        pytest.skip("the C++ CPU kernels did not build here")
    decode_side = quantize(weight, "int4", ["Q4_1"], ops, wide_dtype=torch.bfloat16)
    if decode_side._wide is None:
        pytest.skip("no many-row copy here (oneDNN off)")
    prompt_side = quantize(weight, "int4", ["Q4_1"], ops)
    assert decode_side.nbytes < prompt_side.nbytes  # half the copy's bytes
    rows = torch.randn(9, IN)
    exact = rows @ prompt_side.dequantized().T
    torch.testing.assert_close(prompt_side._wide_product(rows), exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decode_side._wide_product(rows), exact, rtol=0.05, atol=0.05)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quantize(weight, "int4", ["Q4_1"], ops, wide_dtype=torch.float16)
