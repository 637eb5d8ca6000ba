"""Seeded workloads of real text, sized in tokens with the default model's tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from disagg.bench.workloads import (
    MIN_OUTPUT_LEN,
    WORKLOADS,
    WorkloadConfig,
    load_tokenizer,
    make_workload,
    sample_lengths,
)
from disagg.config import EngineConfig
from disagg.engine.gguf_convert import cached_hf_dir
from disagg.engine.loader import default_gguf_path

ENGLISH = {"the", "and", "of", "a", "was", "to", "in", "that", "for", "it", "about"}


@pytest.fixture(scope="module")
def tokenizer_and_context():
    return load_tokenizer()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_and_context):
    return tokenizer_and_context[0]


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_seed_same_requests_other_seed_other_requests(tokenizer, name):
    config = WorkloadConfig(name, num_requests=6, seed=3, length_scale=0.25)
    first, again = make_workload(config, tokenizer), make_workload(config, tokenizer)
    assert first == again
    other = make_workload(WorkloadConfig(name, num_requests=6, seed=4, length_scale=0.25), tokenizer)
    assert [r.prompt for r in other] != [r.prompt for r in first]
    assert len({r.prompt for r in first}) == 6, "every request has its own text (prefix caching would hide prefills)"


@pytest.mark.parametrize("name", WORKLOADS)
def test_prompt_lengths_are_exact_token_counts_within_the_target(tokenizer, name):
    config = WorkloadConfig(name, num_requests=12, seed=0, context_len=2048, length_scale=0.5)
    targets, outputs = sample_lengths(config)
    for req, target, output in zip(make_workload(config, tokenizer), targets, outputs):
        assert req.prompt_len == len(tokenizer.encode(req.prompt)), "what the server will count"
        assert target - 4 <= req.prompt_len <= target
        assert req.output_len == output >= MIN_OUTPUT_LEN
        assert req.prompt_len + req.output_len <= config.context_len


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_request_fits_a_small_context(name):
    prompts, outputs = sample_lengths(
        WorkloadConfig(name, num_requests=300, seed=1, context_len=256, input_len=400, output_len=100)
    )
    assert (prompts + outputs <= 256).all() and (outputs >= MIN_OUTPUT_LEN).all() and (prompts >= 8).all()


def test_chat_lengths_are_sharegpt_shaped():
    prompts, outputs = sample_lengths(WorkloadConfig("chat", num_requests=2000, seed=0))
    assert 120 < np.median(prompts) < 200 and 110 < np.median(outputs) < 170
    assert np.percentile(prompts, 90) > 2.5 * np.median(prompts), "a long tail, as ShareGPT's"
    assert prompts.max() <= 1024 and outputs.max() <= 1024


def test_code_and_summarization_scale_with_the_context():
    for ctx in (2048, 8192):
        code_in, code_out = sample_lengths(WorkloadConfig("code", num_requests=500, seed=0, context_len=ctx))
        summ_in, summ_out = sample_lengths(WorkloadConfig("summarization", num_requests=500, seed=0, context_len=ctx))
        assert ctx / 16 - 1 <= code_in.min() and code_in.max() <= ctx / 8 + 1 and code_out.max() <= 48
        assert summ_in.mean() > ctx / 10 and 64 <= summ_out.min() and summ_out.max() <= 192
        assert code_in.mean() > 5 * code_out.mean(), "code completion: long prompt, short output"


def test_length_scale_scales_every_length():
    full = sample_lengths(WorkloadConfig("summarization", num_requests=200, seed=2))
    half = sample_lengths(WorkloadConfig("summarization", num_requests=200, seed=2, length_scale=0.5))
    assert np.allclose(half[0], full[0] / 2, atol=1) and np.allclose(half[1], full[1] / 2, atol=1)


def test_fixed_lengths(tokenizer):
    reqs = make_workload(WorkloadConfig("fixed", num_requests=4, input_len=100, output_len=7), tokenizer)
    assert all(96 <= r.prompt_len <= 100 and r.output_len == 7 for r in reqs)


def test_the_text_is_real_text(tokenizer):
    chat, code, summary = (
        make_workload(WorkloadConfig(n, num_requests=3, seed=5, context_len=4096, length_scale=0.5), tokenizer)
        for n in ("chat", "code", "summarization")
    )
    for req in chat + summary:
        assert req.prompt.isascii()
        words = re.findall(r"[A-Za-z]+", req.prompt)
        assert len(words) > req.prompt_len / 3 and ENGLISH & {w.lower() for w in words}
        assert sum(len(w) for w in words) / len(words) < 8, "words, not random token soup"
    for req in chat:
        question, _, background = req.prompt.partition(" Some background: ")
        assert question.endswith(("?", ".")) and background, "a chat prompt is a request, then context"
    for req in code:
        assert "def " in req.prompt and "return" in req.prompt and req.prompt.rstrip().endswith(":")
        assert req.output_len < req.prompt_len
    for req in summary:
        assert req.prompt.startswith("Summarize the following article") and req.prompt.endswith("Summary:")


def test_bad_configs_are_refused():
    for bad in (dict(name="poetry"), dict(length_scale=0.0), dict(num_requests=-1), dict(context_len=5)):
        with pytest.raises(ValueError):
            WorkloadConfig(**bad)


def test_a_folder_without_weights_sizes_the_prompts_as_its_model_would(tokenizer_and_context, tmp_path):
    """What `make gpu-kit` carries for the default model: config.json and the tokenizer, no weights."""
    tokenizer, context = tokenizer_and_context
    tokenizer.save_pretrained(tmp_path)
    converted = Path(cached_hf_dir(default_gguf_path(), EngineConfig().cache_dir))
    config = {**json.loads((converted / "config.json").read_text()), "max_position_embeddings": 1234}
    (tmp_path / "config.json").write_text(json.dumps(config))
    alone, alone_context = load_tokenizer(str(tmp_path))
    assert alone_context == 1234 != context
    config = WorkloadConfig("chat", num_requests=4, seed=1, length_scale=0.25)
    assert make_workload(config, alone) == make_workload(config, tokenizer)
