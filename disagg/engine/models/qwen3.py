"""Qwen3 (dense) family: Llama's layers with an RMSNorm over each head of q and of k before RoPE,
no QKV bias, and a head_dim of its own (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1,024).
Sliding windows as Qwen2 reads them (no published Qwen3 sets use_sliding_window)."""

from __future__ import annotations

from disagg.engine.model_config import ModelConfig
from disagg.engine.models.family import ModelFamily
from disagg.engine.models.llama import LlamaForCausalLM
from disagg.engine.models.qwen2 import qwen_window_fields
from disagg.engine.models.weights import decoder_weight_shapes


def config_from_hf(d: dict, name: str) -> ModelConfig:
    bias = bool(d.get("attention_bias", False))
    return ModelConfig.from_hf_dict(d, name, attention_bias=bias, qk_norm=True, **qwen_window_fields(d))


FAMILY = ModelFamily(
    name="qwen3",
    model_types=("qwen3",),
    config_from_hf=config_from_hf,
    model_class=LlamaForCausalLM,
    weight_shapes=decoder_weight_shapes,
)
