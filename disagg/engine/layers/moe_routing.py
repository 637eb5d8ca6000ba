"""Top-k routing of a mixture-of-experts layer: which experts each token goes to, with what weight.

Every family here scores the experts the same way, a softmax over all of them in float32 and the
k best kept, and differs in two details: whether the k weights are renormalised to sum to one
(Mixtral always, which is the same as a softmax over the k best logits; Qwen3-MoE when its
config's `norm_topk_prob` says so), and the dtype the weights are applied in (Qwen3-MoE casts
them back to the router logits' dtype, Mixtral keeps float32), as transformers computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingRule:
    num_experts: int
    top_k: int
    renormalize: bool
    weights_in_logits_dtype: bool = False  # Qwen3-MoE: cast back; Mixtral: float32

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"moe: num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe: num_experts_per_tok must be in 1..{self.num_experts}, got {self.top_k}")


@dataclass
class Routing:
    """Each token's k experts and their weights, best first."""

    expert_ids: torch.Tensor  # [tokens, k] int64
    weights: torch.Tensor  # [tokens, k] float32, or the logits' dtype

    @property
    def num_tokens(self) -> int:
        return self.expert_ids.shape[0]


def route(router_logits: torch.Tensor, rule: RoutingRule) -> Routing:
    """router_logits [tokens, num_experts] -> the tokens' Routing under `rule`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, rule.top_k, dim=-1)
    if rule.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if rule.weights_in_logits_dtype:
        weights = weights.to(router_logits.dtype)
    return Routing(expert_ids, weights)


def expert_load(routing: Routing, num_experts: int) -> torch.Tensor:
    """[num_experts] int64: how many tokens were routed to each expert."""
    return torch.bincount(routing.expert_ids.flatten(), minlength=num_experts)
