"""Qwen3-MoE (model_type qwen3_moe, e.g. Qwen3-30B-A3B): Qwen3's attention (an RMSNorm over each
head of q and k before the rotary embedding, head_dim unlike hidden / heads) and a sparse MoE
MLP in every layer but those `mlp_only_layers` and `decoder_sparse_step` keep dense; no shared
experts. Routing as transformers computes it: softmax over all experts in float32, the top k,
renormalised when `norm_topk_prob`, the weights cast back to the router logits' dtype."""

from __future__ import annotations

import dataclasses

import torch

from disagg.engine.kv_cache import KVCache
from disagg.engine.layers.attention import AttentionMetadata, paged_attention
from disagg.engine.layers.fused import FusedRMSNorm
from disagg.engine.layers.moe_routing import RoutingRule
from disagg.engine.model_config import ModelConfig
from disagg.engine.models.family import ModelFamily
from disagg.engine.models.llama import LlamaAttention
from disagg.engine.models.moe_lm import ExpertNames, MoECausalLM, fused_moe_weight_shapes, moe_weight_shapes
from disagg.errors import ModelLoadError

NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")


class QKNormAttention(LlamaAttention):
    """Llama's attention with an RMSNorm over each head of q and of k, before the rotary embedding."""

    def __init__(self, cfg, cache_index, tp, backends):
        super().__init__(cfg, cache_index, tp, backends)
        self.q_norm = FusedRMSNorm(cfg.head_dim, cfg.rms_norm_eps, backends.attention)
        self.k_norm = FusedRMSNorm(cfg.head_dim, cfg.rms_norm_eps, backends.attention)

    def forward(self, x, cos, sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        n, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(n, heads + 2 * kv_heads, d)
        q = self.q_norm(qkv[:, :heads].reshape(-1, d))[0].view(n, heads, d)
        k = self.k_norm(qkv[:, heads : heads + kv_heads].reshape(-1, d))[0].view(n, kv_heads, d)
        qk = self.rope(torch.cat([q, k], dim=1), cos, sin)  # one rotary call for both
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        kv_cache.write(self.cache_index, meta.slot_mapping, k, v)
        out = paged_attention(q, k, v, kv_cache.layer(self.cache_index), meta, self.scale)
        return self.o_proj(out.view(n, heads * d))


class Qwen3MoeForCausalLM(MoECausalLM):
    EXPERT_NAMES = NAMES

    def make_attention(self, cfg, cache_index, tp, backends):
        return QKNormAttention(cfg, cache_index, tp, backends)

    def routing_rule(self, cfg: ModelConfig) -> RoutingRule:
        return RoutingRule(cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, weights_in_logits_dtype=True)


def config_from_hf(d: dict, name: str) -> ModelConfig:
    if d.get("use_sliding_window"):
        raise ModelLoadError(f"{name or 'qwen3_moe'}: use_sliding_window is not supported for Qwen3-MoE")
    experts = d.get("num_experts", d.get("num_local_experts"))  # transformers 5 writes the latter
    if experts is None:
        raise KeyError("num_experts")
    return dataclasses.replace(
        ModelConfig.from_hf_dict(d, name=name),
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
    weight_shapes=lambda config: moe_weight_shapes(config, NAMES, qk_norm=True),
    other_layouts=(lambda config: fused_moe_weight_shapes(config, qk_norm=True),),
)
