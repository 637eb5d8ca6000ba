"""Rotary position embedding (HF Llama's rotate-half layout), with linear, Llama-3 and YaRN
frequency scaling (HF's `rope_scaling` / `rope_parameters`, computed as transformers does)."""

from __future__ import annotations

import math

import torch
from torch import nn

from disagg.engine.model_config import ROPE_TYPES


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's rule: keep high frequencies, divide low ones by `factor`, blend between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (NTK-by-parts): high frequencies kept, low ones divided by `factor`, a linear ramp
    between the dimensions that rotate beta_fast and beta_slow times over the original context."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = _yarn_correction_range(scaling, head_dim, theta, original)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    interpolation = 1.0 / (factor * (theta ** (torch.arange(0, head_dim, 2).float() / head_dim)))  # HF's rounding
    return interpolation * (1 - extrapolation) + inv_freq * extrapolation


def _yarn_correction_range(scaling: dict, head_dim: int, theta: float, original: int) -> tuple[float, float]:
    def dimension(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dimension(scaling.get("beta_fast") or 32), dimension(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, head_dim - 1)


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: YaRN's 0.1 ln(factor) + 1 (or its configured
    attention_factor, or mscale / mscale_all_dim); 1 for every other rope type."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # float32 throughout, as HF computes it, so positions rotate bit-for-bit alike.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type")
    if rope_type == "llama3":
        inv_freq = llama3_scaled_inv_freq(inv_freq, scaling)
    elif rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "yarn":
        inv_freq = yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    elif rope_type not in (None, "default"):
        raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.max_position = max_position
        self.attention_factor = rope_attention_factor(scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cos_sin: torch.Tensor | None = None

    def _table(self, device: torch.device) -> torch.Tensor:
        # Built lazily and once: [max_position, head_dim] cos and sin, float32.
        if self._cos_sin is None or self._cos_sin.device != device:
            t = torch.arange(self.max_position, dtype=torch.float32, device=device)
            freqs = torch.outer(t, self.inv_freq.to(device))
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos_sin = torch.stack((emb.cos(), emb.sin()))
            if self.attention_factor != 1.0:
                self._cos_sin *= self.attention_factor
        return self._cos_sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for each position, shaped [T, 1, head_dim] to broadcast over heads."""
        table = self._table(positions.device)[:, positions]
        return table[0].unsqueeze(1).to(dtype), table[1].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
