"""Ranking losses over scores (higher = longer output predicted) and the true output lengths.
Pure functions of tensors: lists along the last dimension, any leading batch dimensions.

Only the order of the lengths matters to them, not their values: that is what a scheduler
needs (Fu et al., "Efficient LLM Scheduling by Learning to Rank", NeurIPS 2024), and it spares
the model from predicting a heavy-tailed number.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def list_mle(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """ListMLE (Xia et al. 2008): the Plackett-Luce negative log-likelihood of the true order,
    longest first, averaged over the lists. Tied lengths keep their order in the list (a stable
    sort), so a list of ties is any order at no preference."""
    order = torch.argsort(lengths, dim=-1, descending=True, stable=True)
    ranked = torch.gather(scores, -1, order)
    # Choosing item i first among those not yet chosen: log softmax over ranked[i:].
    tail_logsumexp = torch.logcumsumexp(ranked.flip(-1), dim=-1).flip(-1)
    return (tail_logsumexp - ranked).sum(-1).mean()


def pairwise_logistic(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """RankNet's loss: log(1 + exp(-(s_i - s_j))) averaged over the pairs with length_i >
    length_j (ties say nothing). Zero when a list has no such pair."""
    score_gap = scores.unsqueeze(-1) - scores.unsqueeze(-2)  # [..., i, j] = s_i - s_j
    longer = (lengths.unsqueeze(-1) > lengths.unsqueeze(-2)).to(scores.dtype)
    num_pairs = longer.sum()
    if num_pairs == 0:
        return scores.sum() * 0.0  # keeps the graph: a caller may still call backward
    return (F.softplus(-score_gap) * longer).sum() / num_pairs
