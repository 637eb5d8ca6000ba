"""A mixture-of-experts MLP: router, top-k routing, experts grouped by token, weighted combine.

Each token's k (token, expert) pairs are sorted by expert id (stably, so each expert's rows stay
in token order and a step's decode rows lead), the experts with rows run one GEMM pair each over
all of them (layers/experts.py), and the outputs are weighted and summed back into token order
in expert order, as transformers sums them. No Python loop runs over tokens; one runs over the
experts that have rows.

Parallel: under tensor parallelism each expert's intermediate size is split and the sum
all-reduced, as a dense MLP's; under expert parallelism (ParallelConfig.enable_expert_parallel)
whole experts are split over the same ranks and tokens travel to them by all-to-all
(layers/expert_parallel.py).

Each layer counts the tokens routed to each of its experts (`expert_tokens`): the per-expert load
the worker reports (`disagg:moe_expert_tokens_total`).
"""

from __future__ import annotations

import torch
from torch import nn

from disagg.engine.layers.cpu_gemm import PackedWeight
from disagg.engine.layers.expert_parallel import ExpertDispatch
from disagg.engine.layers.experts import Experts
from disagg.engine.layers.expert_groups import pair_keys, prompt_flags, sort_by_expert, weighted_sum
from disagg.engine.layers.moe_routing import Routing, RoutingRule, expert_load, route
from disagg.engine.layers.parallel import SINGLE, TPGroup


class Router(nn.Module):
    """The gate: a logit per expert for each token (replicated on every rank: it is small)."""

    def __init__(self, hidden_size: int, num_experts: int, gemm: str = "onednn"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.packed = PackedWeight(gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.linear(x, self.weight)


class MoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        rule: RoutingRule,
        tp: TPGroup = SINGLE,
        expert_parallel: bool = False,
        gemm: str = "onednn",
    ):
        """`intermediate_size`: one expert's (config.json's moe_intermediate_size, or Mixtral's
        intermediate_size); `expert_parallel`: split whole experts over `tp`'s ranks."""
        super().__init__()
        self.rule, self.tp = rule, tp
        self.gate = Router(hidden_size, rule.num_experts, gemm)
        self.dispatch = ExpertDispatch(tp, rule.num_experts) if expert_parallel and tp.size > 1 else None
        if self.dispatch is not None:
            self.experts = Experts(self.dispatch.num_local, hidden_size, intermediate_size, SINGLE, gemm)
        else:
            self.experts = Experts(rule.num_experts, hidden_size, intermediate_size, tp, gemm)
        self.register_buffer("expert_tokens", torch.zeros(rule.num_experts, dtype=torch.long), persistent=False)

    @property
    def first_local_expert(self) -> int:
        return self.dispatch.first if self.dispatch is not None else 0

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        """`decode_rows`: the step's leading rows that decode a generated token (None: outside a step)."""
        routing = route(self.gate(x), self.rule)
        self.expert_tokens += expert_load(routing, self.rule.num_experts)
        prompt = prompt_flags(x.shape[0], x.device, decode_rows) if self.experts.quantized else None
        if self.dispatch is not None:
            return self.dispatch(x, routing, prompt, self.experts)
        return self.tp.all_reduce(combine_local(x, routing, prompt, self.experts))


def combine_local(x: torch.Tensor, routing: Routing, prompt: torch.Tensor | None, experts: Experts) -> torch.Tensor:
    """Every expert here: x [tokens, hidden] -> the weighted sum of each token's experts."""
    k = routing.expert_ids.shape[1]
    order, counts, decodes = sort_by_expert(
        pair_keys(routing.expert_ids, prompt), experts.num_local_experts, prompt is not None
    )
    tokens = order // k
    rows = experts(x.index_select(0, tokens), counts, decodes)
    return weighted_sum(rows, routing.weights.flatten()[order], tokens, x.shape[0], x.dtype)
