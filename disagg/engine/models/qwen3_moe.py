"""Qwen3-MoE (model_type qwen3_moe, e.g. Qwen3-30B-A3B): Qwen3's attention (an RMSNorm over each
head of q and k before the rotary embedding, head_dim unlike hidden / heads) and a sparse MoE
MLP in every layer but those `mlp_only_layers` and `decoder_sparse_step` keep dense; no shared
experts. Routing as transformers computes it: softmax over all experts in float32, the top k,
renormalised when `norm_topk_prob`, the weights cast back to the router logits' dtype. With
`use_sliding_window` (no published Qwen3-MoE sets it), every layer slides, as in transformers."""

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

NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")


class Qwen3MoeForCausalLM(MoECausalLM):
    EXPERT_NAMES = NAMES

    def routing_rule(self, cfg: ModelConfig) -> RoutingRule:
        return RoutingRule(cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, weights_in_logits_dtype=True)


def config_from_hf(d: dict, name: str) -> ModelConfig:
    experts = d.get("num_experts", d.get("num_local_experts"))  # transformers 5 writes the latter
    if experts is None:
        raise KeyError("num_experts")
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    return ModelConfig.from_hf_dict(
        d,
        name,
        attention_bias=bool(d.get("attention_bias", False)),
        qk_norm=True,
        sliding_window=window,
        layer_types=(SLIDING_ATTENTION,) * d["num_hidden_layers"] if window else (),
        num_experts=int(experts),
        num_experts_per_tok=int(d["num_experts_per_tok"]),
        moe_intermediate_size=int(d["moe_intermediate_size"]),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
    )


FAMILY = ModelFamily(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    config_from_hf=config_from_hf,
    model_class=Qwen3MoeForCausalLM,
    weight_shapes=lambda config: moe_weight_shapes(config, NAMES),
    other_layouts=(fused_moe_weight_shapes, gguf_moe_weight_shapes),
)
