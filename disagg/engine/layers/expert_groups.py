"""How a mixture-of-experts step groups its (token, expert) pairs, and sums them back.

Shared by the layer on one rank (layers/moe.py) and across ranks (layers/expert_parallel.py):
a pair's sort key is its expert * 2 + whether its row is a prompt's, so a stable sort puts each
expert's rows together in token order with the step's decode rows first (quantized experts take
their kernel for those, layers/experts.py).
"""

from __future__ import annotations

import torch


def prompt_flags(num_tokens: int, device: torch.device, decodes: int | None) -> torch.Tensor | None:
    """[tokens] 1 for a row that is no decode of a generated token (a prompt's), 0 for one that
    is: the step's first `decodes` rows are (AttentionMetadata.decode_rows); None outside an
    engine step. Quantized experts take their kernel for the decode rows."""
    if decodes is None:
        return None
    return (torch.arange(num_tokens, device=device) >= decodes).long()


def pair_keys(expert_ids: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
    """expert_ids [tokens, k] -> [tokens * k] sort keys, token-major: expert * 2 + is-prompt."""
    keys = expert_ids.flatten() * 2
    if prompt is not None:
        keys = keys + prompt.repeat_interleave(expert_ids.shape[1])
    return keys


def sort_by_expert(keys: torch.Tensor, num_experts: int, with_decodes: bool):
    """(order, rows per expert, decode rows per expert or None) of pairs with `keys`: stable, so an
    expert's rows keep their order, decode rows first."""
    order = torch.argsort(keys, stable=True)
    experts = keys // 2
    counts = torch.bincount(experts, minlength=num_experts).tolist()
    if not with_decodes:
        return order, counts, None
    return order, counts, torch.bincount(experts[keys % 2 == 0], minlength=num_experts).tolist()


def weighted_sum(
    rows: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor, num_tokens: int, dtype
) -> torch.Tensor:
    """Each row times its weight, summed into its token: rows in expert order, so every token
    adds its experts in ascending order."""
    out = torch.zeros(num_tokens, rows.shape[1], dtype=dtype, device=rows.device)
    return out.index_add_(0, tokens, (rows * weights.unsqueeze(-1)).to(dtype))
