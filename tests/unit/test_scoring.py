"""Scoring a text (disagg.engine.scoring) against transformers' own log-probabilities.

Every position's log-probability must match HF's on a tiny random model, whether a window runs
as one prefill step, in steps of 1 (the decode path) or in uneven steps (chunks that attend to
earlier ones); perplexity must be llama-perplexity's estimate over those numbers.
"""

from __future__ import annotations

import math

import pytest
import torch

from disagg import LLM
from disagg.engine.scoring import next_token_logprobs, perplexity

VOCAB = 512


@pytest.fixture(scope="module")
def tiny(tiny_gqa_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_gqa_dir, dtype=torch.float32).eval()
    llm = LLM(tiny_gqa_dir, dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    return hf, llm


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def _text(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("step_tokens", [None, 1, 7])
def test_logprobs_match_hf(tiny, step_tokens):
    hf, llm = tiny
    ids = _text(70, seed=step_tokens or 0)
    got = next_token_logprobs(llm.engine, ids, step_tokens)
    assert got.shape == (69,)
    torch.testing.assert_close(got, _hf_logprobs(hf, ids), atol=2e-4, rtol=1e-4)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks, "scoring must give its blocks back"


def test_perplexity_is_llama_perplexitys_estimate(tiny):
    hf, llm = tiny
    ids = _text(3 * 64 + 10, seed=5)  # three windows of 64; the tail is left out, as llama.cpp does
    nll = torch.cat([-_hf_logprobs(hf, ids[w * 64 : (w + 1) * 64])[32:] for w in range(3)])
    got = perplexity(llm.engine, ids, context=64)
    assert (got.num_windows, got.num_scored) == (3, 3 * 31)
    assert got.value == pytest.approx(math.exp(nll.mean().item()), rel=1e-4)
    assert got.stderr == pytest.approx(got.value * nll.std().item() / math.sqrt(len(nll)), rel=1e-2)


def test_bad_input_is_refused(tiny):
    _, llm = tiny
    with pytest.raises(ValueError, match="at least 2"):
        next_token_logprobs(llm.engine, [1])
    with pytest.raises(ValueError, match="at least 64"):
        perplexity(llm.engine, _text(63, seed=1), context=64)
