"""Each model family beyond Llama against transformers' own class, greedy, token for token, fp32.

A tiny random checkpoint per family (tests/conftest.py FAMILY_SHAPES: Mistral with a 32-token
window on every layer; Qwen2 with YaRN and 48-token windows on two of three layers; Qwen3 with
q/k norms and head_dim 32 over hidden 64; Gemma 3 with local and global layers, two RoPE bases,
GeGLU, four unit-offset norms, scaled embeddings, query_pre_attn_scalar and logit softcapping).
All prompts of a case go into one generate call (mixed lengths up to 12 windows long, so
sliding windows bind in prefill chunks and in decodes), with the default token budget and one
that chunks every prompt over 64 tokens; the windowed families again through the torch
attention path, with every row as a decode (batch_invariant), and with a warm prefix cache.
"""

from __future__ import annotations

import pytest
import torch
from support import describe_mismatches, hf_greedy, random_prompts

from disagg import LLM, SamplingParams

FAMILIES = ["mistral", "qwen2", "qwen3", "gemma3"]
WINDOWED = ["mistral", "qwen2", "gemma3"]
PROMPT_LENGTHS = [1, 7, 16, 31, 33, 64, 100, 129, 250, 400]
VOCAB = 512
MAX_TOKENS = 20
BUDGETS = [512, 64]


@pytest.fixture(scope="module")
def family_case(family_dir):
    """kind -> (model dir, prompts, HF greedy tokens, HF logit margins); built on first use."""
    cache: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in cache:
            from transformers import AutoModelForCausalLM

            model_dir = family_dir(kind)
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            prompts = random_prompts(PROMPT_LENGTHS, VOCAB, seed=11)
            refs = [hf_greedy(hf, p, MAX_TOKENS, with_margins=True) for p in prompts]
            cache[kind] = (model_dir, prompts, [r[0] for r in refs], [r[1] for r in refs])
        return cache[kind]

    return get


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(out.outputs[0].finish_reason == "length" for out in outs)
    return [list(out.outputs[0].token_ids) for out in outs]


def assert_matches(llm: LLM, case, label: str) -> None:
    _, prompts, expected, margins = case
    got = generate(llm, prompts)
    assert got == expected, f"{label}:\n" + describe_mismatches(prompts, expected, got, margins)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks, "blocks still held after generate"


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("kind", FAMILIES)
def test_family_greedy_matches_hf(family_case, kind, budget):
    case = family_case(kind)
    llm = LLM(model=case[0], dtype="float32", max_num_batched_tokens=budget, num_kv_blocks=256)
    assert_matches(llm, case, f"{kind}, budget {budget}")


@pytest.mark.parametrize("kind", WINDOWED)
def test_windowed_family_on_the_torch_attention_path(family_case, kind):
    case = family_case(kind)
    llm = LLM(model=case[0], dtype="float32", max_num_batched_tokens=64, num_kv_blocks=256, attention_backend="torch")
    assert llm.engine.runner.decode_kernel is None
    assert_matches(llm, case, f"{kind}, torch attention")


@pytest.mark.parametrize("kind", WINDOWED)
def test_windowed_family_with_every_row_as_a_decode(family_case, kind):
    case = family_case(kind)
    llm = LLM(model=case[0], dtype="float32", max_num_batched_tokens=64, num_kv_blocks=256, batch_invariant=True)
    if not llm.engine.runner.rows_as_decodes:
        pytest.skip("batch_invariant needs the C++ decode kernel, which did not build here")
    assert_matches(llm, case, f"{kind}, batch_invariant")


def test_windowed_family_with_a_warm_prefix_cache(family_case):
    case = family_case("gemma3")
    llm = LLM(model=case[0], dtype="float32", max_num_batched_tokens=64, num_kv_blocks=256, enable_prefix_caching=True)
    assert_matches(llm, case, "gemma3, cold prefix cache")
    assert_matches(llm, case, "gemma3, warm prefix cache")


def test_the_models_layer_windows(family_dir):
    """What the block-freeing work reads: each layer's window, and the layers grouped by it."""
    llm = LLM(model=family_dir("gemma3"), dtype="float32", num_kv_blocks=16)
    assert llm.engine.model.local_attention_windows == [32, 32, None, 32]
    groups = llm.engine.model_config.layer_groups
    assert [(g.window, g.layers) for g in groups] == [(None, (2,)), (32, (0, 1, 3))]


@pytest.mark.parametrize("step_tokens", [None, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_family_logprobs_match_hf_at_every_position(family_dir, kind, step_tokens):
    """Not only the argmax: each position's log-probabilities over a prompt 5 windows long (the
    logit softcap changes these and never the greedy token), as one prefill and one decode at a time."""
    from transformers import AutoModelForCausalLM

    from disagg.engine.scoring import next_token_logprobs

    model_dir = family_dir(kind)
    tokens = random_prompts([160], VOCAB, seed=5)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0, :-1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=32)
    got = next_token_logprobs(llm.engine, tokens, step_tokens)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
