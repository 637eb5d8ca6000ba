"""Gemma 3 (text) family, model_type gemma3_text, as transformers' Gemma3ForCausalLM computes it.

What differs from Llama: five sliding-window layers (local, 1,024 tokens in the published
models) to each global one (`layer_types`, or `sliding_window_pattern` in older configs); the
local layers rotate by their own RoPE base (`rope_local_base_freq`, unscaled), the global ones by
rope_theta with rope_scaling; four norms a layer (before and after attention, before and after
the MLP); every RMSNorm scales by 1 + weight; a norm over each head of q and of k; a GeGLU MLP
(gelu, tanh approximation); embeddings multiplied by sqrt(hidden_size) (rounded to the model's
dtype, as transformers does); scores scaled by query_pre_attn_scalar^-1/2; logits soft-capped
where final_logit_softcapping is set. attn_logit_softcapping is not applied, as in transformers'
Gemma 3 (its attention never passes it on). The multimodal `gemma3` checkpoints are refused
(model_specs), and so are bidirectional (embedding) ones.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from disagg.engine.layers.fused import FusedRMSNorm
from disagg.engine.layers.parallel import TPGroup
from disagg.engine.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, rope_scaling_from_hf
from disagg.engine.models.causal_lm import Backends, CausalLM
from disagg.engine.models.family import ModelFamily
from disagg.engine.models.llama import LlamaAttention, LlamaMLP
from disagg.engine.models.weights import decoder_weight_shapes

GEMMA3_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, model: CausalLM, cfg: ModelConfig, layer_index: int, cache_index: int, tp: TPGroup, backends: Backends
    ):
        super().__init__()
        qk_norm = functools.partial(model.make_norm, cfg, backends)
        self.self_attn = LlamaAttention(cfg, layer_index, cache_index, tp, backends, qk_norm)
        self.mlp = LlamaMLP(cfg, tp, backends)
        self.input_layernorm = model.make_norm(cfg, backends)
        self.post_attention_layernorm = model.make_norm(cfg, backends)
        self.pre_feedforward_layernorm = model.make_norm(cfg, backends)
        self.post_feedforward_layernorm = model.make_norm(cfg, backends)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta))[0]
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h, meta.decode_rows))[0], residual


class Gemma3ForCausalLM(CausalLM):
    def make_layer(self, cfg, layer_index, cache_index, tp, backends):
        return Gemma3DecoderLayer(self, cfg, layer_index, cache_index, tp, backends)

    def make_norm(self, cfg: ModelConfig, backends: Backends, size: int | None = None) -> nn.Module:
        return FusedRMSNorm(size or cfg.hidden_size, cfg.rms_norm_eps, backends.attention, unit_offset=True)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.embed_tokens(input_ids)
        return rows * torch.tensor(self.config.hidden_size**0.5, dtype=rows.dtype)

    def compute_logits(self, hidden: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, decode_rows)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


# ---- config.json -> ModelConfig -------------------------------------------------------------------
def config_from_hf(d: dict, name: str) -> ModelConfig:
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: a bidirectional Gemma 3 (an embedding model) is no causal LM")
    return ModelConfig.from_hf_dict(
        d,
        name,
        head_dim=d.get("head_dim", 256),
        max_position_embeddings=d.get("max_position_embeddings", 131072),
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        attention_bias=bool(d.get("attention_bias", False)),
        hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        qk_norm=True,
        norms_per_layer=len(GEMMA3_LAYER_NORMS),
        query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        sliding_window=d.get("sliding_window", 4096),
        layer_types=tuple(d.get("layer_types") or _layer_types(d)),
        **_rope_fields(d),
    )


def _layer_types(d: dict) -> list[str]:
    """Older configs: every `sliding_window_pattern`-th layer global, the others local."""
    pattern = d.get("sliding_window_pattern", 6)
    return [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(d["num_hidden_layers"])]


def _rope_fields(d: dict) -> dict:
    """Global and local RoPE: transformers 5 nests them in rope_parameters by layer type; older
    configs have rope_theta, rope_scaling (global) and rope_local_base_freq."""
    params = d.get("rope_parameters") or {}
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        full, local = params.get(FULL_ATTENTION) or {}, params.get(SLIDING_ATTENTION) or {}
    else:
        full = dict(d.get("rope_scaling") or {}, rope_theta=d.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": d.get("rope_local_base_freq", 10_000.0)}
    if rope_scaling_from_hf({"rope_scaling": local}) is not None:
        raise ValueError(f"rope_parameters: scaled RoPE on sliding layers ({local}) is not supported")
    return {
        "rope_theta": full.get("rope_theta", 1_000_000.0),
        "rope_scaling": rope_scaling_from_hf(
            {"rope_scaling": full, "max_position_embeddings": d.get("max_position_embeddings", 131072)}
        ),
        "rope_local_theta": local.get("rope_theta", 10_000.0),
    }


FAMILY = ModelFamily(
    name="gemma3",
    model_types=("gemma3_text",),
    config_from_hf=config_from_hf,
    model_class=Gemma3ForCausalLM,
    weight_shapes=functools.partial(decoder_weight_shapes, layer_norms=GEMMA3_LAYER_NORMS),
)
