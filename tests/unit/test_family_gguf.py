"""GGUF files of the new families, written here as llama.cpp's converter writes them (tensor names,
metadata keys, Llama's Q/K row permutation for a Mistral, Gemma's norms stored plus one), in F32
from a tiny transformers checkpoint: loaded through the engine's GGUF path, greedy output equals
transformers' on the checkpoint itself."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from support import _COMMON, FAMILY_SHAPES, make_family_checkpoint
from support import describe_mismatches, hf_greedy, random_prompts

from disagg import LLM, SamplingParams

PROMPT_LENGTHS = [1, 17, 40, 100, 250]
MAX_TOKENS = 12
GGUF_ARCH = {"mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}
# llama.cpp's names (gguf.constants' TENSOR_NAMES); Gemma's ffn_norm is the norm before its MLP.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA3_LAYER_NAMES = {
    **LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip


def _gguf_name(hf_name: str, kind: str) -> str:
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    names = GEMMA3_LAYER_NAMES if kind == "gemma3" else LAYER_NAMES
    return f"blk.{index}.{names[module]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_family_gguf(path, hf_model, kind: str) -> str:
    config, arch = hf_model.config, GGUF_ARCH[kind]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config, kind)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        writer.add_tensor(_gguf_name(name, kind), _as_llama_cpp_stores(name, tensor, config, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _as_llama_cpp_stores(name: str, tensor: torch.Tensor, config, kind: str) -> np.ndarray:
    array = tensor.float().numpy().copy()
    if kind == "mistral" and (".q_proj." in name or ".k_proj." in name):
        array = _llama_cpp_permute(
            array, config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
        )
    if kind == "gemma3" and name.endswith("norm.weight"):
        array = array + 1  # llama.cpp's Gemma converters: its RMSNorm multiplies by the weight alone
    return array


def _write_metadata(writer, config, kind: str) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"] if kind == "gemma3" else rope["rope_theta"])
    _write_rope_scaling(writer, rope["full_attention"] if kind == "gemma3" else rope)
    if kind == "gemma3" and config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
        if kind != "mistral":  # Mistral: every layer
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])


def _write_rope_scaling(writer, rope: dict) -> None:
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


@pytest.mark.parametrize("kind", sorted(GGUF_ARCH))
def test_a_family_gguf_greedy_matches_hf(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    # A GGUF does not carry Gemma 3's query_pre_attn_scalar: llama.cpp takes head_dim (but for the 27B).
    overrides = {"query_pre_attn_scalar": FAMILY_SHAPES["gemma3"][2]["head_dim"]} if kind == "gemma3" else {}
    model_dir = make_family_checkpoint(tmp_path / "hf", kind, seed=21, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    path = write_family_gguf(tmp_path / f"{kind}.gguf", hf, kind)
    prompts = random_prompts(PROMPT_LENGTHS, _COMMON["vocab_size"], seed=3)
    refs = [hf_greedy(hf, p, MAX_TOKENS, with_margins=True) for p in prompts]
    expected, margins = [r[0] for r in refs], [r[1] for r in refs]
    llm = LLM(model=path, dtype="float32", max_num_batched_tokens=64, num_kv_blocks=128,
              cache_dir=str(tmp_path / "cache"))  # fmt: skip
    assert llm.engine.model_config.architecture == hf.config.model_type
    assert llm.engine.model_config.layer_groups == _groups(hf.config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == expected, f"{kind} from GGUF:\n" + describe_mismatches(prompts, expected, got, margins)


def _groups(hf_config):
    from disagg.engine.models import config_from_hf

    return config_from_hf(hf_config.to_dict()).layer_groups
