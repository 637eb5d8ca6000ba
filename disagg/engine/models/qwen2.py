"""Qwen2 / Qwen2.5 family: Llama's layers with a bias on Q, K and V; RoPE scaling by YaRN where the
config asks (Qwen2.5's long-context setting); a sliding window on the layers from
`max_window_layers` on when `use_sliding_window` is set (or as `layer_types` names them)."""

from __future__ import annotations

from disagg.engine.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from disagg.engine.models.family import ModelFamily
from disagg.engine.models.llama import LlamaForCausalLM
from disagg.engine.models.weights import decoder_weight_shapes


def qwen_window_fields(d: dict) -> dict:
    """sliding_window and layer_types as transformers' Qwen2Config / Qwen3Config read them:
    the window only under use_sliding_window, on the layers that layer_types (or, without it,
    `i >= max_window_layers`) mark."""
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    if window is None:
        return {"sliding_window": None, "layer_types": ()}
    layers = d["num_hidden_layers"]
    first = d.get("max_window_layers", layers)
    derived = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(layers)]
    return {"sliding_window": window, "layer_types": tuple(d.get("layer_types") or derived)}


def config_from_hf(d: dict, name: str) -> ModelConfig:
    # transformers' Qwen2Attention always has Q, K and V biases (its config has no attention_bias).
    return ModelConfig.from_hf_dict(d, name, attention_bias=True, **qwen_window_fields(d))


FAMILY = ModelFamily(
    name="qwen2",
    model_types=("qwen2",),
    config_from_hf=config_from_hf,
    model_class=LlamaForCausalLM,
    weight_shapes=decoder_weight_shapes,
)
