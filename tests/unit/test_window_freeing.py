"""A windowed request's freed blocks, engine-level: Mistral's tiny random checkpoint (a 32-token
window on every layer, 16-token blocks; tests/conftest.py FAMILY_SHAPES). A 400-token prompt's
blocks are released as they leave the window: after its prefill it holds the window's 2 blocks,
3 at most while it decodes, none at the end; prefix caching over released blocks stays exact
(greedy equal to transformers' for the same prompt twice and for one sharing only a prefix).
Gemma 3 (local and global layers) holds every block: no block table per layer group here."""

from __future__ import annotations

import pytest
import torch
from support import hf_greedy, random_prompts

from disagg import LLM, SamplingParams
from disagg.engine.block_manager import PLACEHOLDER, num_held

WINDOW, BLOCK = 32, 16
MAX_TOKENS = 12


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_a_400_token_prompt_holds_only_its_window(family_dir):
    llm = LLM(model=family_dir("mistral"), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
    engine = llm.engine
    prompt = random_prompts([400], 512, seed=1)[0]
    request = engine.add_request("a", prompt_token_ids=prompt, sampling_params=_greedy())
    held_while_decoding = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if request.is_finished:
            break
        assert num_held(request.block_ids) == engine.block_manager.num_used_blocks
        if outputs and request.num_output_tokens == 1:  # the prompt is done: its last window is held
            assert engine.block_manager.num_used_blocks == -(-WINDOW // BLOCK)
            assert request.block_ids[:23] == [PLACEHOLDER] * 23  # (400 - 32 + 1) // 16 blocks released
        elif request.num_output_tokens > 1:
            held_while_decoding.append(engine.block_manager.num_used_blocks)
    assert held_while_decoding and max(held_while_decoding) == -(-WINDOW // BLOCK) + 1
    assert engine.num_free_blocks == engine.num_total_blocks
    assert engine.block_manager.peak_num_used_blocks <= 7  # a 64-token chunk and its window: (31 + 64) / 16 + 1


def test_a_model_of_local_and_global_layers_holds_every_block(family_dir):
    llm = LLM(model=family_dir("gemma3"), dtype="float32", num_kv_blocks=64)
    assert llm.engine.block_manager.sliding_window is None
    prompt = random_prompts([200], 512, seed=2)[0]
    request = llm.engine.add_request("a", prompt_token_ids=prompt, sampling_params=_greedy(4))
    while not request.num_output_tokens:
        llm.engine.step()
    assert request.num_released_blocks == 0 and num_held(request.block_ids) == -(-200 // BLOCK)


def test_prefix_hits_over_released_blocks_are_exact(family_dir):
    """The same long prompt twice, then one sharing only its first 160 tokens: each greedy equal
    to transformers', the second and third served partly from the released blocks' cache."""
    from transformers import AutoModelForCausalLM

    model_dir = family_dir("mistral")
    long_prompt, tail = random_prompts([300, 90], 512, seed=4)
    prompts = [long_prompt, long_prompt, long_prompt[:160] + tail]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, enable_prefix_caching=True)
    got, cached = [], []
    for prompt in prompts:  # one after another: each finds what the ones before left cached
        out = llm.generate([{"prompt_token_ids": prompt}], _greedy(), use_tqdm=False)[0]
        got.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens)
    assert got == expected
    assert cached[0] == 0 and cached[1] == (300 - 1) // BLOCK * BLOCK and cached[2] == 160
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


@pytest.mark.parametrize("policy", ["chunked", "prefill_first"])
def test_a_request_is_refused_only_when_its_window_cannot_fit(family_dir, policy):
    """12 blocks hold 192 tokens: a 400-token prompt fits through its window when chunked by 64
    tokens, not when prefill_first computes it whole in one step."""
    from disagg.errors import InvalidRequestError

    llm = LLM(
        model=family_dir("mistral"),
        dtype="float32",
        num_kv_blocks=12,
        scheduling_policy=policy,
        max_num_batched_tokens=64,
    )
    prompt = random_prompts([400], 512, seed=1)[0]
    if policy == "chunked":
        llm.engine.add_request("a", prompt_token_ids=prompt, sampling_params=_greedy())
    else:
        with pytest.raises(InvalidRequestError, match="KV blocks"):
            llm.engine.add_request("a", prompt_token_ids=prompt, sampling_params=_greedy())
