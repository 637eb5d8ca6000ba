"""EngineConfig.batch_invariant: with quantized weights, a decode row takes the quantized kernel
however many rows decode together, so greedy outputs do not depend on the batch (by default more
than 4 decode rows take the float copy, whose sums differ in the last bits)."""

from __future__ import annotations

import pytest
import torch
from support import random_prompts

from disagg import LLM, SamplingParams
from disagg.engine.layers.cpu_kernels import cpu_ops
from disagg.engine.layers.quantized import Int4Weight, step_rows

OUT, IN = 96, 256


@pytest.fixture
def ops():
    ops = cpu_ops(torch.device("cpu"), "auto")
    if ops is None:
        pytest.skip("the C++ CPU kernels did not build here")
    return ops


def test_six_decode_rows_take_the_kernel_only_when_batch_invariant(ops):
    torch.manual_seed(8)
    weight = Int4Weight(torch.randn(OUT, IN) * 0.05, kernels=ops)
    weight._pack_wide(weight.dequantized())
    if weight._wide is None:
        pytest.skip("no float copy here (oneDNN off): one path only")
    rows = torch.randn(6, IN)
    with step_rows(6):
        default = weight.linear(rows)
        weight.max_narrow_decodes = None
        invariant = weight.linear(rows)
    assert torch.equal(invariant, weight._narrow(rows))  # row by row, as one row alone
    assert torch.equal(invariant[:1], weight._narrow(rows[:1]))
    assert torch.equal(default, weight._wide_product(rows))  # the copy: what batch_invariant avoids


def test_the_setting_reaches_every_quantized_layer(tiny_llama_dir):
    def narrow_limits(llm) -> set:
        return {m.packed.max_narrow_decodes for m in llm.engine.model.modules() if hasattr(m, "packed")}

    assert narrow_limits(LLM(model=tiny_llama_dir, weights="int4", num_kv_blocks=32)) == {4}
    assert narrow_limits(LLM(model=tiny_llama_dir, weights="int4", num_kv_blocks=32, batch_invariant=True)) == {None}


def test_greedy_outputs_alone_and_among_seven_are_equal(tiny_llama_dir, ops):
    llm = LLM(model=tiny_llama_dir, weights="int4", num_kv_blocks=128, batch_invariant=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 9, 17, 30, 3, 12, 40, 22], 256, seed=9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
