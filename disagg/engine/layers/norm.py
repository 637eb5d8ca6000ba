"""RMSNorm with the residual add folded in (one pass instead of two)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False):
        """`unit_offset`: the checkpoint stores the scale less one (Gemma), so scale by 1 + weight."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual) where new residual = x + residual."""
        if residual is not None:
            x = x + residual
        residual = x
        # Statistics in float32, as HF does, so bfloat16 matches the reference closely.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # Gemma scales in float32, then rounds (HF's Gemma3RMSNorm)
            return (normed * (1.0 + self.weight.float())).to(x.dtype), residual
        return self.weight * normed.to(x.dtype), residual

    def scale(self) -> torch.Tensor:
        """What the normalized rows are multiplied by."""
        return 1.0 + self.weight if self.unit_offset else self.weight
