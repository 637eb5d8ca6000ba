"""Named real model shapes (for `random:<shape>` weights) and the tensors a shape implies.

Random weights of a real shape let us measure speed and memory of a big model without its
checkpoint; the numbers come from each model's published config.json.
"""

from __future__ import annotations

from disagg.engine.model_config import ModelConfig

_LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def named_shapes() -> dict[str, ModelConfig]:
    """A fresh dict each call, so that no caller can change another's view."""
    return {
        "llama3-8b": _config(
            "llama",
            128256,
            4096,
            14336,
            32,
            32,
            8,
            131072,
            rope_theta=500000.0,
            rope_scaling=dict(_LLAMA3_ROPE_SCALING),
            bos_token_id=128000,
            eos_token_ids=(128001, 128008, 128009),
        ),
        "llama2-7b": _config("llama", 32000, 4096, 11008, 32, 32, 32, 4096),
        "llama2-13b": _config("llama", 32000, 5120, 13824, 40, 40, 40, 4096),
        "qwen2-7b": _config(
            "qwen2",
            152064,
            3584,
            18944,
            28,
            28,
            4,
            32768,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            attention_bias=True,
            bos_token_id=151643,
            eos_token_ids=(151645, 151643),
        ),
        "smollm2-135m": _config(
            "llama", 49152, 576, 1536, 30, 9, 3, 8192, rope_theta=100000.0, tie_word_embeddings=True
        ),
        "tiny": _config("llama", 512, 64, 128, 2, 4, 2, 2048),
    }


def _config(arch, vocab, hidden, inter, layers, heads, kv_heads, max_pos, **extra) -> ModelConfig:
    extra.setdefault("bos_token_id", 1)
    extra.setdefault("eos_token_ids", (2,))
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_pos,
        **extra,
    )


def expected_weight_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a checkpoint of this shape holds, by Hugging Face name, in load order."""
    h, q_out = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_out, inter = config.num_key_value_heads * config.head_dim, config.intermediate_size
    shapes = [("model.embed_tokens.weight", (config.vocab_size, h))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q_out, h))]
        shapes += [(p + "self_attn.k_proj.weight", (kv_out, h)), (p + "self_attn.v_proj.weight", (kv_out, h))]
        if config.attention_bias:
            shapes += [
                (p + "self_attn.q_proj.bias", (q_out,)),
                (p + "self_attn.k_proj.bias", (kv_out,)),
                (p + "self_attn.v_proj.bias", (kv_out,)),
            ]
        shapes += [(p + "self_attn.o_proj.weight", (h, q_out)), (p + "post_attention_layernorm.weight", (h,))]
        shapes += [
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        shapes.append(("lm_head.weight", (config.vocab_size, h)))
    return shapes
