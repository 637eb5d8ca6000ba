"""Shared fixtures: tiny random Hugging Face checkpoints of the shapes the engine must support.

Each is saved as a safetensors directory (the layout the HF-directory loader reads), with fixed
seeds, so that a test can load it both into our engine and into transformers as the oracle.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from support import _COMMON, FAMILY_SHAPES, FAMILY_WINDOW, RESIDUAL_GAIN, default_gguf_location, make_family_checkpoint  # noqa: F401

# Tests run the engine with dense float32 weights unless they ask otherwise (weights="auto"):
# quantized weights load slower (they are packed at load) and change greedy outputs where a
# model is torn between two tokens, which tests comparing two runs token for token would trip
# on. Set before any engine, Ray worker or served subprocess starts, so that they inherit it.
os.environ.setdefault("DISAGG_WEIGHTS", "fp32")

NUM_THREADS = 2

TINY_SHAPES = {
    # name: (architecture, extra config fields)
    "llama": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "gqa": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=500000.0)),
    "untied": (
        "llama",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, num_hidden_layers=3),
    ),
    "qwen2_bias": (
        "qwen2",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1000000.0),
    ),
}


@pytest.fixture(autouse=True)
def _limit_threads():
    torch.set_num_threads(NUM_THREADS)
    yield


def make_tiny_checkpoint(path, kind: str, seed: int = 0):
    """Write a random LlamaForCausalLM / Qwen2ForCausalLM of shape `kind` to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    arch, extra = TINY_SHAPES[kind]
    fields = {**_COMMON, **extra}
    torch.manual_seed(seed)
    if arch == "qwen2":
        config = Qwen2Config(**fields, use_sliding_window=False)
        model = Qwen2ForCausalLM(config)
        # HF initialises biases to zero; random ones make the test actually check they are applied.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.1)
    else:
        config = LlamaConfig(**fields, attention_bias=False, mlp_bias=False)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger residual updates, so that attention (and thus the KV cache) rather than the
        # input token's own embedding decides the next token; otherwise tied random models
        # just repeat one token and would hide position or cache bugs.
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(RESIDUAL_GAIN)
            layer.mlp.down_proj.weight.mul_(RESIDUAL_GAIN)
    model = model.to(torch.float32).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _tiny_dir(tmp_path_factory, kind: str, seed: int) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{kind}"), kind, seed)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """Llama, multi-head attention (4/4 heads), tied embeddings."""
    return _tiny_dir(tmp_path_factory, "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_gqa_dir(tmp_path_factory) -> str:
    """Llama with grouped-query attention (8 query heads, 2 KV heads), tied embeddings."""
    return _tiny_dir(tmp_path_factory, "gqa", seed=2)


@pytest.fixture(scope="session")
def tiny_untied_dir(tmp_path_factory) -> str:
    """Llama with a separate lm_head (untied), GQA 4/2, three layers."""
    return _tiny_dir(tmp_path_factory, "untied", seed=3)


@pytest.fixture(scope="session")
def tiny_qwen2_bias_dir(tmp_path_factory) -> str:
    """Qwen2 with QKV bias (non-zero), GQA 4/2, untied."""
    return _tiny_dir(tmp_path_factory, "qwen2_bias", seed=4)


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory):
    """kind -> the directory of its FAMILY_SHAPES checkpoint, written on first use."""
    dirs: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in dirs:
            seed = zlib.crc32(kind.encode()) % 1000  # fixed per kind, whatever other kinds exist
            dirs[kind] = make_family_checkpoint(tmp_path_factory.mktemp(f"family_{kind}"), kind, seed)
        return dirs[kind]

    return get


# Mixture-of-experts checkpoints: 8 experts, 2 a token, expert matrices of 32 (a whole block of
# the quantized kernels). Qwen3-MoE: per-head q/k norms, head_dim 32 (not hidden / heads), layer
# 1 kept dense (mlp_only_layers), weights not renormalised; Mixtral: renormalised, every layer sparse.
TINY_MOE_SHAPES = {
    "qwen3_moe": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=3, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1],
        rope_theta=1000000.0,
    ),
    "mixtral": dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, num_local_experts=8,
        num_experts_per_tok=2, intermediate_size=32, sliding_window=None,
    ),
    "mixtral_window": dict(  # every layer slides over 32 tokens, as Mistral-7B-v0.1's 4,096
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, num_local_experts=8,
        num_experts_per_tok=2, intermediate_size=32, sliding_window=32,
    ),
}  # fmt: skip


def make_tiny_moe_checkpoint(path, kind: str, seed: int = 0, **overrides):
    """Write a random Qwen3MoeForCausalLM / MixtralForCausalLM of shape `kind` (with `overrides`
    of its config fields) to `path` (transformers' save_pretrained: one tensor per expert matrix)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    qwen = kind.startswith("qwen3_moe")
    config_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if qwen else (MixtralConfig, MixtralForCausalLM)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**_COMMON, **TINY_MOE_SHAPES[kind], **overrides}))
    with torch.no_grad():
        for layer in model.model.layers:  # as make_tiny_checkpoint, for the same reason
            layer.self_attn.o_proj.weight.mul_(RESIDUAL_GAIN)
            down = getattr(layer.mlp, "experts", layer.mlp).down_proj
            (down if isinstance(down, torch.nn.Parameter) else down.weight).mul_(RESIDUAL_GAIN)
    model = model.to(torch.float32).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> str:
    return make_tiny_moe_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", seed=11)


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory) -> str:
    return make_tiny_moe_checkpoint(tmp_path_factory.mktemp("tiny_mixtral"), "mixtral", seed=12)


@pytest.fixture(scope="session")
def tiny_mixtral_window_dir(tmp_path_factory) -> str:
    return make_tiny_moe_checkpoint(tmp_path_factory.mktemp("tiny_mixtral_window"), "mixtral_window", seed=13)


@pytest.fixture(scope="session")
def tiny_moe_checkpoint(tmp_path_factory):
    """(kind, seed, **config overrides) -> the directory of a new make_tiny_moe_checkpoint (a
    fixture, so that test modules need not import conftest: several exist)."""

    def make(kind: str, seed: int = 0, **overrides) -> str:
        return make_tiny_moe_checkpoint(tmp_path_factory.mktemp(f"moe_{kind}"), kind, seed, **overrides)

    return make


@pytest.fixture(scope="session")
def default_hf_reference():
    """(tokenizer, model) of transformers loaded from the default GGUF (the oracle of the default
    model's tests): dequantized once a session (~14 s), read-only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_name = default_gguf_location()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32).eval()
    return tokenizer, model
