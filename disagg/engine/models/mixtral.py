"""Mixtral (model_type mixtral, e.g. Mixtral-8x7B): Mistral's attention (Llama's) and a sparse MoE
MLP in every layer, its experts named w1 (gate), w3 (up), w2 (down) under `block_sparse_moe`.
Routing as transformers computes it: softmax over all experts in float32, the top k renormalised
(the same as a softmax over the k best logits), the weights kept in float32.

`sliding_window` must be null (Mixtral-8x7B's published config has it so); a windowed Mixtral is
refused at load."""

from __future__ import annotations

import dataclasses

from disagg.engine.layers.moe_routing import RoutingRule
from disagg.engine.model_config import ModelConfig
from disagg.engine.models.family import ModelFamily
from disagg.engine.models.llama import LlamaAttention
from disagg.engine.models.moe_lm import ExpertNames, MoECausalLM, fused_moe_weight_shapes, moe_weight_shapes
from disagg.errors import ModelLoadError

NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")


class MixtralForCausalLM(MoECausalLM):
    EXPERT_NAMES = NAMES

    def make_attention(self, cfg, cache_index, tp, backends):
        return LlamaAttention(cfg, cache_index, tp, backends)

    def routing_rule(self, cfg: ModelConfig) -> RoutingRule:
        return RoutingRule(cfg.num_experts, cfg.num_experts_per_tok, renormalize=True)


def config_from_hf(d: dict, name: str) -> ModelConfig:
    if d.get("sliding_window") is not None:
        raise ModelLoadError(
            f"{name or 'mixtral'}: sliding_window {d['sliding_window']} is not supported for Mixtral (only null)"
        )
    experts = d.get("num_local_experts", d.get("num_experts"))
    if experts is None:
        raise KeyError("num_local_experts")
    return dataclasses.replace(
        ModelConfig.from_hf_dict(d, name=name),
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
    other_layouts=(fused_moe_weight_shapes,),
)
