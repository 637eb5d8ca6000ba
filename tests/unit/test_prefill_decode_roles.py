"""Disaggregation inside one process: a PREFILL engine's exported KV, imported into a DECODE
engine, must decode exactly the tokens a COLOCATED engine produces.

The two engines are driven in one interleaved loop, as a real pair of workers would be: while
some requests are still prefilling on P (chunked, small budget), others have been handed over
and are decoding on D. Every test ends with every KV block free on every engine.
"""

from __future__ import annotations

import math

import pytest
from support import random_prompts

from disagg import LLM, EngineConfig, Role, SamplingParams
from disagg.config import DEFAULT_MODEL
from disagg.engine.engine import LLMEngine

MAX_STEPS = 5000


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _colocated_tokens(model: str, prompts: list[list[int]], max_tokens: int, **engine_args) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_tokens), use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    return [list(o.outputs[0].token_ids) for o in outs]


def _assert_kv_shape(kv, engine: LLMEngine, num_prompt_tokens: int, layer: int | None) -> None:
    """Head-major blocks: [L?, 2 (K, V), kv_heads, n_blocks, block_size, head_dim]."""
    cfg, bs = engine.model_config, engine.config.block_size
    got = tuple(kv.shape) if layer is not None else tuple(kv.shape[1:])
    if layer is None:
        assert kv.shape[0] == cfg.num_hidden_layers, (
            f"export_blocks: {kv.shape[0]} layers, model has {cfg.num_hidden_layers}"
        )
    expected = (2, cfg.num_key_value_heads, got[2], bs, cfg.head_dim)
    assert got == expected, (
        f"export_blocks shape {tuple(kv.shape)}, expected [L?, 2, {cfg.num_key_value_heads}, n, {bs}, {cfg.head_dim}]"
    )
    assert got[2] >= math.ceil(num_prompt_tokens / bs), (
        f"export_blocks holds {got[2]} blocks for a {num_prompt_tokens}-token prompt"
    )


def _transfer(prefill: LLMEngine, decode: LLMEngine, rid: str, num_prompt_tokens: int, per_layer: bool) -> None:
    """Move one request's prompt KV from P's held blocks into D's reserved ones, whole or layer
    by layer (what the KV transfer does between processes)."""
    source = prefill.scheduler.requests[rid].block_ids
    target = decode.scheduler.requests[rid].block_ids
    if per_layer:
        for layer in range(prefill.model_config.num_hidden_layers):
            kv = prefill.kv_cache.export_blocks(source, layer)
            _assert_kv_shape(kv, prefill, num_prompt_tokens, layer)
            decode.kv_cache.import_blocks(target, kv.clone(), layer)
    else:
        kv = prefill.kv_cache.export_blocks(source)
        _assert_kv_shape(kv, prefill, num_prompt_tokens, None)
        decode.kv_cache.import_blocks(target, kv.clone())


def run_disaggregated(
    prefill: LLMEngine, decode: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams
) -> dict[str, list[int]]:
    """Drive P and D together until every request has finished decoding on D.

    The handshake comes first (D reserves blocks), then P prefills; each request is handed over
    as soon as P reports its first token, while P keeps prefilling the others and D keeps decoding.
    """
    for rid, prompt in prompts.items():
        block_ids = decode.reserve_for_remote_prefill(rid, prompt, params)
        assert block_ids is not None, f"decode engine had no room for {rid}"
        assert len(block_ids) >= math.ceil(len(prompt) / decode.config.block_size)
        assert len(set(block_ids)) == len(block_ids)
    assert not any(decode.step() for _ in range(2)), "a request waiting for KV must not produce tokens"
    for rid, prompt in prompts.items():
        prefill.add_request(rid, prompt_token_ids=prompt, sampling_params=params)

    first_tokens: dict[str, int] = {}
    finals: dict[str, list[int]] = {}
    for step in range(MAX_STEPS):
        if len(finals) == len(prompts):
            break
        for out in prefill.step():
            if not out.finished:
                continue
            rid = out.request_id
            assert rid not in first_tokens, f"{rid} reported finished twice by the prefill engine"
            assert len(out.outputs[0].token_ids) == 1, (
                f"prefill engine returned {out.outputs[0].token_ids} for {rid}, expected one token"
            )
            first_tokens[rid] = out.outputs[0].token_ids[0]
            _transfer(prefill, decode, rid, len(prompts[rid]), per_layer=len(first_tokens) % 2 == 0)
            decode.finish_kv_import(rid, first_tokens[rid])
            prefill.release_kv(rid)  # P frees its blocks once D has them (the "ack")
        for out in decode.step():
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = list(out.outputs[0].token_ids)
    else:
        pytest.fail(f"not finished after {MAX_STEPS} steps: prefilled {sorted(first_tokens)}, decoded {sorted(finals)}")
    assert not prefill.has_unfinished_requests() and not decode.has_unfinished_requests()
    for rid, tokens in finals.items():
        assert tokens[0] == first_tokens[rid], f"{rid}: decode output must start with the imported first token"
    return finals


def _assert_all_free(*engines: LLMEngine) -> None:
    for engine in engines:
        role = engine.config.role
        assert engine.num_free_blocks == engine.num_total_blocks, (
            f"{role}: {engine.num_total_blocks - engine.num_free_blocks} blocks still held"
        )


def _engines(model: str, prefill_budget: int, num_kv_blocks: int = 256, **engine_args) -> tuple[LLMEngine, LLMEngine]:
    common = dict(model=model, dtype="float32", num_kv_blocks=num_kv_blocks, **engine_args)
    prefill = LLMEngine(EngineConfig(role=Role.PREFILL, max_num_batched_tokens=prefill_budget, **common))
    decode = LLMEngine(EngineConfig(role=Role.DECODE, **common))
    return prefill, decode


# --- tiny models -------------------------------------------------------------------------------

# Block-aligned (16, 32) and unaligned lengths, one long prompt chunked by the 48-token budget.
TINY_LENGTHS = [1, 5, 16, 17, 32, 77, 300]
TINY_MAX_TOKENS = 12


@pytest.mark.parametrize("kind", ["gqa", "qwen2_bias"])
def test_disaggregated_equals_colocated_tiny(request, kind):
    model = request.getfixturevalue(f"tiny_{kind}_dir")
    prompts = random_prompts(TINY_LENGTHS, 512, seed=11)
    # Wave 2 shares prefixes with wave 1 (a cache hit on P must still export the full prompt KV),
    # including an exact repeat of a wave-1 prompt.
    wave2 = [prompts[6][:64] + prompts[1], prompts[5][:40], list(prompts[4])]
    expected = _colocated_tokens(model, prompts + wave2, TINY_MAX_TOKENS, num_kv_blocks=256)

    prefill, decode = _engines(model, prefill_budget=48)
    params = _greedy(TINY_MAX_TOKENS)
    got1 = run_disaggregated(prefill, decode, {f"a{i}": p for i, p in enumerate(prompts)}, params)
    got2 = run_disaggregated(prefill, decode, {f"b{i}": p for i, p in enumerate(wave2)}, params)

    for i, p in enumerate(prompts):
        assert got1[f"a{i}"] == expected[i], (
            f"prompt a{i} (len {len(p)}): colocated {expected[i]}, disaggregated {got1[f'a{i}']}"
        )
    for i, p in enumerate(wave2):
        exp = expected[len(prompts) + i]
        assert got2[f"b{i}"] == exp, (
            f"prompt b{i} (len {len(p)}, shared prefix): colocated {exp}, disaggregated {got2[f'b{i}']}"
        )
    _assert_all_free(prefill, decode)


def test_seeded_sampling_disaggregated_equals_colocated(tiny_gqa_dir):
    """A seeded request samples the same stream whether its first token comes from a prefill
    instance and the rest from a decode instance, or all from one engine."""
    prompts = random_prompts([9, 40], 512, seed=4)
    params = SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True)
    llm = LLM(model=tiny_gqa_dir, dtype="float32", num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in outs]
    assert expected[0] != expected[1]
    prefill, decode = _engines(tiny_gqa_dir, prefill_budget=64, num_kv_blocks=64)
    got = run_disaggregated(prefill, decode, {f"s{i}": p for i, p in enumerate(prompts)}, params)
    assert [got["s0"], got["s1"]] == expected
    _assert_all_free(prefill, decode)


def test_abandoned_transfers_free_their_blocks(tiny_gqa_dir):
    """A handshake that never completes, or a prefill whose KV is never taken, frees everything."""
    prefill, decode = _engines(tiny_gqa_dir, prefill_budget=64, num_kv_blocks=64)
    prompt = random_prompts([40], 512, seed=3)[0]
    params = _greedy(8)

    assert decode.reserve_for_remote_prefill("r1", prompt, params)
    assert decode.num_free_blocks < decode.num_total_blocks
    decode.abort_request("r1")  # e.g. the transfer timed out
    assert not decode.has_unfinished_requests()

    prefill.add_request("r1", prompt_token_ids=prompt, sampling_params=params)
    for _ in range(20):
        if any(o.finished for o in prefill.step()):
            break
    assert prefill.num_free_blocks < prefill.num_total_blocks, "PREFILL must hold the KV until released"
    prefill.release_kv("r1")  # e.g. the decode side died
    _assert_all_free(prefill, decode)


# --- the default model -------------------------------------------------------------------------

TEXTS = [
    "Hi",
    "Write a short poem about the sea and the wind.",
    "Explain, step by step, how a bill becomes a law in the United States. " * 6,
    "The quick brown fox jumps over the lazy dog while the cat watches from the window. " * 18,
]


@pytest.mark.slow
def test_disaggregated_equals_colocated_default_model():
    colocated = LLM(dtype="float32", num_kv_blocks=256)
    outs = colocated.generate(TEXTS, _greedy(12), use_tqdm=False)
    prompts = {f"d{i}": list(o.prompt_token_ids) for i, o in enumerate(outs)}
    assert max(len(p) for p in prompts.values()) > 300, "need one prompt long enough to be chunked"

    prefill, decode = _engines(DEFAULT_MODEL, prefill_budget=64)
    got = run_disaggregated(prefill, decode, prompts, _greedy(12))
    for i, o in enumerate(outs):
        assert got[f"d{i}"] == list(o.outputs[0].token_ids), f"prompt d{i} (len {len(prompts[f'd{i}'])})"
    _assert_all_free(prefill, decode, colocated.engine)
