"""Named real model shapes (for `random:<shape>` weights).

Random weights of a real shape let us measure speed and memory of a big model without its
checkpoint; the numbers come from each model's published config.json. The tensors a shape
implies are its family's (disagg.engine.models.expected_weight_shapes).
"""

from __future__ import annotations

from disagg.engine.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig

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
        # Qwen/Qwen3-8B's config.json: head_dim 128, q/k norms, untied, no sliding window.
        "qwen3-8b": _config(
            "qwen3",
            151936,
            4096,
            12288,
            36,
            32,
            8,
            40960,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            qk_norm=True,
            bos_token_id=151643,
            eos_token_ids=(151645,),
        ),
        # mistralai/Mistral-7B-v0.1's config.json: a 4,096-token window on every layer.
        "mistral-7b-v0.1": _config(
            "mistral",
            32000,
            4096,
            14336,
            32,
            32,
            8,
            32768,
            sliding_window=4096,
            layer_types=(SLIDING_ATTENTION,) * 32,
        ),
        # Mistral-7B-v0.1's layout (4 query heads per KV head, a 4,096-token window on every layer)
        # at a tiny width, which runs on a CPU in seconds (the sliding-window benchmark); "-global"
        # is the same shape with every layer attending to every position.
        "tiny-mistral": _config(
            "mistral", 512, 128, 256, 4, 8, 2, 32768, sliding_window=4096, layer_types=(SLIDING_ATTENTION,) * 4
        ),
        "tiny-mistral-global": _config("mistral", 512, 128, 256, 4, 8, 2, 32768),
        # google/gemma-3-12b's text_config: 48 layers, every 6th global, the others 1,024-token local
        # windows; head_dim 256 over hidden 3,840 and 16 heads; linear RoPE scaling 8 on the global layers.
        "gemma3-12b": _config(
            "gemma3_text",
            262208,
            3840,
            15360,
            48,
            16,
            8,
            131072,
            head_dim=256,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            rope_local_theta=10000.0,
            tie_word_embeddings=True,
            hidden_act="gelu_pytorch_tanh",
            qk_norm=True,
            norms_per_layer=4,
            query_pre_attn_scalar=256,
            sliding_window=1024,
            layer_types=every_nth_global(48, 6),
            bos_token_id=2,
            eos_token_ids=(1,),
        ),
        "tiny": _config("llama", 512, 64, 128, 2, 4, 2, 2048),
        # Mixtures of experts. Qwen3-30B-A3B: 128 experts of 768, 8 a token (30.5B total, 3.3B active).
        "qwen3-30b-a3b": _config("qwen3_moe", 151936, 2048, 6144, 48, 32, 4, 40960, **_QWEN3_MOE),
        # Mixtral-8x7B(-v0.1): 8 experts of 14336, 2 a token (46.7B total, 12.9B active); sliding_window null.
        "mixtral-8x7b": _config(
            "mixtral", 32000, 4096, 14336, 32, 32, 8, 32768, rope_theta=1000000.0,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
        ),
        # For benchmarks on one CPU host, Qwen3-30B-A3B scaled down (it takes 122 GB in float32):
        # width, heads, expert count and expert size halved, a quarter of the layers, a 32k
        # vocabulary; 1.0B total, 0.24B active. "-dense": the same model with each MoE layer
        # replaced by one dense MLP as wide as a token's 8 experts together (the same active parameters).
        "qwen3-moe-mini": _config("qwen3_moe", 32768, 1024, 3072, 12, 16, 2, 40960, **_QWEN3_MOE_MINI),
        "qwen3-moe-mini-dense": _config(
            "qwen3_moe", 32768, 1024, 3072, 12, 16, 2, 40960, **_QWEN3_MOE_MINI, mlp_only_layers=tuple(range(12))
        ),
        # The same in miniature, for tests and smoke runs: 8 experts of 32, 2 a token.
        "tiny-moe": _config("qwen3_moe", 512, 64, 64, 2, 4, 2, 2048, **_TINY_MOE),
        "tiny-moe-dense": _config("qwen3_moe", 512, 64, 64, 2, 4, 2, 2048, **_TINY_MOE, mlp_only_layers=(0, 1)),
    }  # fmt: skip


# Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B): head_dim 128, norm_topk_prob true, every layer sparse.
_QWEN3_MOE = dict(
    head_dim=128, qk_norm=True, rms_norm_eps=1e-6, rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, bos_token_id=151643, eos_token_ids=(151645,),
)  # fmt: skip
_QWEN3_MOE_MINI = dict(
    head_dim=128, qk_norm=True, rms_norm_eps=1e-6, rope_theta=1000000.0, num_experts=64, num_experts_per_tok=8,
    moe_intermediate_size=384, norm_topk_prob=True,
)  # fmt: skip
_TINY_MOE = dict(qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def every_nth_global(layers: int, n: int) -> tuple[str, ...]:
    """Gemma 3's pattern: layer i global where (i + 1) is a multiple of n, sliding otherwise."""
    return tuple(SLIDING_ATTENTION if (i + 1) % n else FULL_ATTENTION for i in range(layers))


def _config(arch, vocab, hidden, inter, layers, heads, kv_heads, max_pos, **extra) -> ModelConfig:
    extra.setdefault("bos_token_id", 1)
    extra.setdefault("eos_token_ids", (2,))
    extra.setdefault("head_dim", hidden // heads)
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        **extra,
    )
