"""EngineConfig.batch_invariant: with quantized weights every row, prompt or decode, takes the
quantized kernel row by row, so a request recomputed with the tokens it generated (a
migration) continues as it would have, and a prompt's rows are computed alike in chunks or
whole. By default a decode's row takes the kernel and a prompt's rows a float copy, whose sums
are not the kernel's (each path independent of the batch: test_batch_independence.py)."""

from __future__ import annotations

import pytest
import torch
from support import random_prompts

from disagg import LLM, SamplingParams
from disagg.engine.layers.cpu_kernels import cpu_ops
from disagg.engine.layers.quantized import Int4Weight

OUT, IN = 96, 256
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture
def ops():
    ops = cpu_ops(torch.device("cpu"), "auto")
    if ops is None:
        pytest.skip("the C++ CPU kernels did not build here")
    return ops


def test_every_row_takes_the_kernel_only_when_batch_invariant(ops):
    torch.manual_seed(8)
    weight = Int4Weight(torch.randn(OUT, IN) * 0.05, kernels=ops)
    weight._pack_wide(weight.dequantized())
    if weight._wide is None:
        pytest.skip("no float copy here (oneDNN off): one path only")
    rows = torch.randn(6, IN)
    default_decodes = weight.linear(rows, decode_rows=6)
    default_prompt = weight.linear(rows, decode_rows=0)
    weight.every_row_narrow = True
    invariant_prompt = weight.linear(rows, decode_rows=0)
    invariant_decodes = weight.linear(rows, decode_rows=6)
    narrow = weight._narrow(rows)
    assert torch.equal(invariant_decodes, narrow) and torch.equal(invariant_prompt, narrow)
    assert torch.equal(narrow[:1], weight._narrow(rows[:1]))  # row by row: the same alone
    assert torch.equal(default_decodes, narrow)  # decode rows: the kernel, however many
    assert torch.equal(default_prompt, weight._wide_product(rows))  # what batch_invariant avoids


def test_the_setting_reaches_every_quantized_weight(tiny_llama_dir):
    def flags(llm) -> set:
        model = llm.engine.model
        packed = [m.packed for m in model.modules() if hasattr(m, "packed")] + [model.logits_weight]
        return {w.every_row_narrow for w in packed}

    assert flags(LLM(model=tiny_llama_dir, weights="int4", num_kv_blocks=32)) == {False}
    assert flags(LLM(model=tiny_llama_dir, weights="int4", num_kv_blocks=32, batch_invariant=True)) == {True}


def test_greedy_outputs_alone_and_among_seven_are_equal(tiny_llama_dir, ops):
    llm = LLM(model=tiny_llama_dir, weights="int4", num_kv_blocks=128, batch_invariant=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 9, 17, 30, 3, 12, 40, 22], 256, seed=9)]
    params = SamplingParams(max_tokens=12, **GREEDY)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


def test_a_request_recomputed_with_its_tokens_continues_as_it_would_have(tiny_llama_dir, ops):
    """What a migration by recompute does: the prompt plus the tokens generated so far become
    the new prompt, and the rest must be what the first run went on to generate. (Without
    batch_invariant, 9 of these 24 prompts on this model continue otherwise: the generated
    tokens' rows, decoded with int8 activations, are recomputed as prompt rows in float32.)"""
    llm = LLM(model=tiny_llama_dir, weights="int4", num_kv_blocks=256, batch_invariant=True)
    for seed in range(6):
        for prompt in random_prompts([7, 20, 33, 50], 256, seed=seed):
            full = list(llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=24, **GREEDY),
                                     use_tqdm=False)[0].outputs[0].token_ids)  # fmt: skip
            resumed = llm.generate([{"prompt_token_ids": prompt + full[:8]}], SamplingParams(max_tokens=16, **GREEDY),
                                   use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
            assert list(resumed) == full[8:], f"prompt of {len(prompt)} tokens (seed {seed})"


def test_a_prompt_in_chunks_and_whole_gives_the_same_numbers(tiny_gqa_dir, ops):
    """Every row's attention through the decode kernel, so a prompt split into chunks of 16
    (each attending to the cached ones before it) computes what it computes in one piece: the
    sampled tokens' logprobs to the last bit."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([40, 77], 256, seed=12)]
    params = SamplingParams(max_tokens=6, logprobs=0, **GREEDY)

    def run(budget: int):
        llm = LLM(model=tiny_gqa_dir, weights="int4", num_kv_blocks=128, batch_invariant=True,
                  max_num_batched_tokens=budget, long_prefill_token_threshold=0, enable_prefix_caching=False)  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[(t, lp[t]) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]

    assert run(16) == run(512)
