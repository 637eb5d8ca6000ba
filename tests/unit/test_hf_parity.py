"""Correctness oracle: greedy output equals transformers' greedy `generate`, token for token.

All prompts of a case go into ONE `generate` call, so batching, chunked prefill (small token
budget), paged KV and mixed prefill/decode steps are all exercised against the reference.
References are generated one prompt at a time, so the oracle itself has no padding.
"""

from __future__ import annotations

import pytest
import torch
from support import describe_mismatches, hf_greedy, random_prompts

from disagg import LLM, SamplingParams

TINY_KINDS = ["llama", "gqa", "untied", "qwen2_bias"]
# 1..400 tokens, with block-boundary cases (block_size 16) and prompts longer than a 64 budget.
TINY_PROMPT_LENGTHS = [1, 2, 7, 16, 17, 33, 64, 129, 250, 400]
TINY_VOCAB = 512
TINY_MAX_TOKENS = 20
BUDGETS = [512, 64]  # the default budget, and one that chunks every prompt longer than 64


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run_engine(llm, prompts: list[list[int]], max_tokens: int):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_tokens), use_tqdm=False)
    assert len(outs) == len(prompts)
    for p, out in zip(prompts, outs):
        assert list(out.prompt_token_ids) == p, "outputs must come back in input order"
        assert out.finished
        assert out.outputs[0].finish_reason == "length"
    return [list(out.outputs[0].token_ids) for out in outs]


def _assert_all_blocks_free(llm) -> None:
    engine = llm.engine
    assert engine.num_free_blocks == engine.num_total_blocks, (
        f"{engine.num_total_blocks - engine.num_free_blocks} KV blocks still held after generate"
    )


# --- tiny random checkpoints, loaded through the safetensors-directory loader ---------------------


@pytest.fixture(scope="module")
def tiny_cases(request):
    """kind -> (model dir, prompts, HF greedy tokens, HF logit margins); built on first use."""
    cache: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in cache:
            from transformers import AutoModelForCausalLM

            model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            prompts = random_prompts(TINY_PROMPT_LENGTHS, TINY_VOCAB, seed=7)
            refs = [hf_greedy(hf, p, TINY_MAX_TOKENS, with_margins=True) for p in prompts]
            cache[kind] = (model_dir, prompts, [r[0] for r in refs], [r[1] for r in refs])
        return cache[kind]

    return get


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_greedy_matches_hf(tiny_cases, kind, budget):
    model_dir, prompts, expected, margins = tiny_cases(kind)
    llm = LLM(model=model_dir, dtype="float32", max_num_batched_tokens=budget, num_kv_blocks=256)
    got = _run_engine(llm, prompts, TINY_MAX_TOKENS)
    assert got == expected, f"{kind}, budget {budget}:\n" + describe_mismatches(prompts, expected, got, margins)
    _assert_all_blocks_free(llm)


def test_tiny_greedy_matches_hf_under_kv_pressure(tiny_cases):
    """Too few KV blocks for all prompts at once: requests must wait or be preempted and recomputed,
    never produce different tokens. 40 blocks hold the longest request (27 blocks) but not all (76)."""
    model_dir, prompts, expected, margins = tiny_cases("gqa")
    llm = LLM(model=model_dir, dtype="float32", max_num_batched_tokens=64, num_kv_blocks=40)
    got = _run_engine(llm, prompts, TINY_MAX_TOKENS)
    assert got == expected, describe_mismatches(prompts, expected, got, margins)
    _assert_all_blocks_free(llm)


def test_tiny_repeated_generate_is_deterministic(tiny_cases):
    """A second generate on the same LLM (warm prefix cache) gives the same tokens as the first."""
    model_dir, prompts, expected, margins = tiny_cases("untied")
    llm = LLM(
        model=model_dir, dtype="float32", max_num_batched_tokens=64, num_kv_blocks=256, enable_prefix_caching=True
    )
    first = _run_engine(llm, prompts, TINY_MAX_TOKENS)
    second = _run_engine(llm, prompts, TINY_MAX_TOKENS)
    assert first == expected, describe_mismatches(prompts, expected, first, margins)
    assert second == expected, "with the prefix cache warm:\n" + describe_mismatches(prompts, expected, second, margins)
    _assert_all_blocks_free(llm)


# --- the default model (SmolLM2-135M-Instruct, from its GGUF) ------------------------------------

DEFAULT_PROMPT_LENGTHS = [1, 5, 16, 31, 64, 130, 257, 400]
DEFAULT_MAX_TOKENS = 16

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined a screw press, oil-based ink and movable metal type into a system that could produce "
    "books quickly and cheaply. Before that, every copy of a text was written by hand, usually by "
    "monks in monasteries, and a single book could take months to finish. The new machines spread "
    "across Europe within a few decades: by the year 1500 there were presses in more than two "
    "hundred cities. Prices fell, literacy rose, and ideas travelled faster than ever before. "
    "Scientists could share their results, reformers could publish pamphlets, and merchants could "
    "print price lists and contracts. Historians still argue about how much of the modern world "
    "grew out of this one invention, but few doubt that it changed how people learned, argued and "
    "remembered. Today the same questions are asked about computers, networks and language models, "
    "which can produce text even faster than any press. "
)


@pytest.fixture(scope="module")
def default_reference(default_hf_reference):
    return default_hf_reference


@pytest.fixture(scope="module")
def default_case(default_reference):
    """Real-text prompts of several lengths (different windows of the text) and HF's greedy tokens."""
    tokenizer, model = default_reference
    text_ids = tokenizer(TEXT * 4, add_special_tokens=False).input_ids
    prompts = [text_ids[7 * i : 7 * i + n] for i, n in enumerate(DEFAULT_PROMPT_LENGTHS)]
    assert [len(p) for p in prompts] == DEFAULT_PROMPT_LENGTHS
    refs = [hf_greedy(model, p, DEFAULT_MAX_TOKENS, with_margins=True) for p in prompts]
    return prompts, [r[0] for r in refs], [r[1] for r in refs]


@pytest.mark.slow
@pytest.mark.parametrize("budget", BUDGETS)
def test_default_model_greedy_matches_hf(default_case, budget):
    prompts, expected, margins = default_case
    llm = LLM(dtype="float32", weights="fp32", max_num_batched_tokens=budget)
    got = _run_engine(llm, prompts, DEFAULT_MAX_TOKENS)
    assert got == expected, f"default model, budget {budget}:\n" + describe_mismatches(prompts, expected, got, margins)
    _assert_all_blocks_free(llm)


@pytest.mark.slow
def test_default_model_answers_capital_of_france(default_reference):
    tokenizer, _ = default_reference
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    llm = LLM()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    # A text prompt is tokenized as transformers' tokenizer does it.
    assert list(out.prompt_token_ids) == tokenizer(prompt).input_ids
