"""Mistral family: Llama's layers, and a sliding window on every layer where the config sets one
(Mistral-7B-v0.1: 4,096 tokens; v0.2 on: none). As transformers' MistralModel, a `layer_types`
in the config is not read: `sliding_window` alone decides."""

from __future__ import annotations

from disagg.engine.model_config import SLIDING_ATTENTION, ModelConfig
from disagg.engine.models.family import ModelFamily
from disagg.engine.models.llama import LlamaForCausalLM
from disagg.engine.models.weights import decoder_weight_shapes


def config_from_hf(d: dict, name: str) -> ModelConfig:
    window = d.get("sliding_window")
    layer_types = (SLIDING_ATTENTION,) * d["num_hidden_layers"] if window else ()
    return ModelConfig.from_hf_dict(d, name, sliding_window=window, layer_types=layer_types)


FAMILY = ModelFamily(
    name="mistral",
    model_types=("mistral",),
    config_from_hf=config_from_hf,
    model_class=LlamaForCausalLM,
    weight_shapes=decoder_weight_shapes,
)
