"""Mixtral (model_type mixtral, e.g. Mixtral-8x7B): Mistral's attention (Llama's, with a sliding
window on every layer where `sliding_window` is set; Mixtral-8x7B's published config has it
null) and a sparse MoE MLP in every layer, its experts named w1 (gate), w3 (up), w2 (down) under
`block_sparse_moe`. Routing as transformers computes it: softmax over all experts in float32,
the top k renormalised (the same as a softmax over the k best logits), the weights kept in float32."""

from __future__ import annotations

from disagg.engine.layers.moe_routing import RoutingRule
from disagg.engine.model_config import SLIDING_ATTENTION, ModelConfig
from disagg.engine.models.family import ModelFamily
from disagg.engine.models.moe_lm import (
    ExpertNames,
    MoECausalLM,
    fused_moe_weight_shapes,
    gguf_moe_weight_shapes,
    moe_weight_shapes,
)

NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


class MixtralForCausalLM(MoECausalLM):
    EXPERT_NAMES = NAMES

    def routing_rule(self, cfg: ModelConfig) -> RoutingRule:
        return RoutingRule(cfg.num_experts, cfg.num_experts_per_tok, renormalize=True)


def config_from_hf(d: dict, name: str) -> ModelConfig:
    experts = d.get("num_local_experts", d.get("num_experts"))
    if experts is None:
        raise KeyError("num_local_experts")
    window = d.get("sliding_window")
    return ModelConfig.from_hf_dict(
        d,
        name,
        sliding_window=window,
        layer_types=(SLIDING_ATTENTION,) * d["num_hidden_layers"] if window else (),
        num_experts=int(experts),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=int(d["intermediate_size"]),  # every layer's MLP is experts of this size
        norm_topk_prob=True,
    )


FAMILY = ModelFamily(
    name="mixtral",
    model_types=("mixtral",),
    config_from_hf=config_from_hf,
    model_class=MixtralForCausalLM,
    weight_shapes=lambda config: moe_weight_shapes(config, NAMES),
    other_layouts=(fused_moe_weight_shapes, gguf_moe_weight_shapes),
)
