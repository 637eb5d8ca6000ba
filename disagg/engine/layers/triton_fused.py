"""The small kernels around a layer's GEMMs on a GPU, in Triton, one launch each: RMSNorm with
the residual add folded in, rotary embedding of q and k fused with the KV write into the paged
cache, and the gated activations (SiLU-mul, GELU-tanh-mul) of the MLP.

Each is a chain of 3-8 torch ops of one small kernel each (a CUDA graph replays them, but
every one is a launch and a pass over memory). Each rounds where torch rounds (bfloat16 after
each op that torch computes in bfloat16), so that a model's numbers stay those of the torch path
(layers/norm.py, rotary.py, linear.py): the engine's greedy outputs do not depend on which ran.

Arithmetic is float32 throughout: values are loaded, widened, computed and rounded back to the
tensor's dtype, as torch's own kernels do. (Triton's interpreter, which the unit tests run these
under, also computes nothing right in bfloat16 itself: it holds bfloat16 as raw 16-bit integers.)

Imports Triton: reached through gpu_kernels.py, which says where it runs. Under TRITON_INTERPRET=1
(set before this module is imported) the kernels run on CPU tensors (tests/unit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GATED_BLOCK = 1024  # activation columns per program
SQRT_2_OVER_PI = 0.7978845608028654


# ---- RMSNorm (+ residual) --------------------------------------------------------------------------
@triton.jit
def _rms_norm(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_xr, stride_xg, stride_rr, stride_rg, n, eps,
    HAS_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    group = tl.program_id(1)
    groups = tl.num_programs(1)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    dtype = out_ptr.dtype.element_ty
    out_at = (row * groups + group) * n + cols  # out (and res_out) are contiguous
    x = tl.load(x_ptr + row * stride_xr + group * stride_xg + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(res_ptr + row * stride_rr + group * stride_rg + cols, mask=ok, other=0.0)
        x = (x + residual.to(tl.float32)).to(dtype).to(tl.float32)  # torch adds in the model's dtype
        tl.store(res_out_ptr + out_at, x.to(dtype), mask=ok)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if UNIT_OFFSET:  # Gemma: scaled in float32, then rounded
        y = normed * (1.0 + w)
    else:  # rounded, then scaled in the model's dtype
        y = normed.to(dtype).to(tl.float32) * w
    tl.store(out_ptr + out_at, y.to(dtype), mask=ok)


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.forward's (normed, new residual) for x [T, N] or [T, heads, N] (the last dimension
    contiguous; rows may be strided, as a split of a fused projection gives them)."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm: the normalized dimension must be contiguous")
    rows, groups, n = (x.shape[0], 1, x.shape[1]) if x.dim() == 2 else x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else x
    res = residual if residual is not None else x
    _rms_norm[(rows, groups)](
        x, res, weight, out, res_out,
        x.stride(0), x.stride(1) if x.dim() == 3 else 0, res.stride(0), res.stride(1) if res.dim() == 3 else 0,
        n, eps,
        HAS_RESIDUAL=residual is not None, UNIT_OFFSET=unit_offset, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return out, res_out


# ---- rotary embedding + the KV write ----------------------------------------------------------------
@triton.jit
def _rotary_kv_write(
    qk_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr, cache_ptr,
    stride_qt, stride_qh, stride_vt, stride_vh, stride_ct, stride_cache_kv, stride_cache_h, stride_cache_slot,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """Program (token, head): heads [0, H) are q's, [H, H + KVH) k's, then v's. q and k heads are
    rotated in place; k and v heads are also stored at the token's cache slot."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HALF_PAD)
    ok = d < HALF
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if h < NUM_HEADS + NUM_KV_HEADS:
        at = qk_ptr + t * stride_qt + h * stride_qh + d
        dtype = qk_ptr.dtype.element_ty
        x1 = tl.load(at, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + t * stride_ct + d, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_ct + d, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_ct + HALF + d, mask=ok, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product and the sum rounded as torch rounds them
        y1 = ((x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)).to(dtype)
        y2 = ((x2 * c2).to(dtype).to(tl.float32) + (x1 * s2).to(dtype).to(tl.float32)).to(dtype)
        tl.store(at, y1, mask=ok)
        tl.store(at + HALF, y2, mask=ok)
        if h >= NUM_HEADS:
            dest = cache_ptr + (h - NUM_HEADS) * stride_cache_h + slot * stride_cache_slot + d
            tl.store(dest, y1.to(cache_ptr.dtype.element_ty), mask=ok)
            tl.store(dest + HALF, y2.to(cache_ptr.dtype.element_ty), mask=ok)
    else:
        head = h - NUM_HEADS - NUM_KV_HEADS
        src = v_ptr + t * stride_vt + head * stride_vh + d
        dest = cache_ptr + stride_cache_kv + head * stride_cache_h + slot * stride_cache_slot + d
        tl.store(dest, tl.load(src, mask=ok, other=0.0).to(cache_ptr.dtype.element_ty), mask=ok)
        tl.store(dest + HALF, tl.load(src + HALF, mask=ok, other=0.0).to(cache_ptr.dtype.element_ty), mask=ok)


def rotary_kv_write(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> None:
    """Rotates qk [T, H + KVH, D] (q's heads, then k's) in place by cos, sin ([T, 1, D] or [T, D]),
    and stores the rotated k and v [T, KVH, D] at their flat slots (block * block_size + offset)
    of kv_layer [2, KVH, blocks, block_size, D]: apply_rotary, then KVCache.write, in one launch."""
    tokens, heads, head_dim = qk.shape
    num_kv_heads = v.shape[1]
    if heads != num_heads + num_kv_heads or head_dim % 2:
        raise ValueError(f"rotary_kv_write: {heads} q and k heads, {num_kv_heads} v heads, head dim {head_dim}")
    for name, t in (("qk", qk), ("v", v), ("cos", cos), ("sin", sin), ("kv_layer", kv_layer)):
        if t.stride(-1) != 1:
            raise ValueError(f"rotary_kv_write: {name}'s last dimension must be contiguous")
    if kv_layer.stride(2) != kv_layer.shape[3] * kv_layer.stride(3) or cos.stride(0) != sin.stride(0):
        raise ValueError("rotary_kv_write: a layer's blocks must be contiguous, and cos and sin alike")
    half = head_dim // 2
    _rotary_kv_write[(tokens, heads + num_kv_heads)](
        qk, v, cos, sin, slot_mapping, kv_layer,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(3),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, HALF_PAD=triton.next_power_of_2(half),
    )  # fmt: skip


# ---- gated activations ------------------------------------------------------------------------------
@triton.jit
def _gated(x_ptr, out_ptr, stride_xt, stride_ot, width, GELU_TANH: tl.constexpr, BLOCK: tl.constexpr):
    """act(gate) * up for one token's columns [j * BLOCK, (j + 1) * BLOCK) of x = [gate; up]."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + width + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU_TANH:  # 0.5 x (1 + tanh(z)) = x * sigmoid(2z), z = sqrt(2/pi) (x + 0.044715 x^3)
        z = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * z))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    y = act.to(dtype).to(tl.float32) * up  # torch rounds the activation, then the product
    tl.store(out_ptr + t * stride_ot + cols, y.to(dtype), mask=ok)


def gated_activation(x: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """x [T, 2I] = [gate; up] (a fused gate/up projection's output) -> act(gate) * up [T, I];
    act: SiLU, or GELU's tanh approximation (GeGLU, HF's gelu_pytorch_tanh)."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % 2:
        raise ValueError(f"gated_activation: expected [tokens, 2 * width] with contiguous rows, got {tuple(x.shape)}")
    width = x.shape[1] // 2
    out = torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device)
    block = min(GATED_BLOCK, triton.next_power_of_2(width))
    _gated[(x.shape[0], triton.cdiv(width, block))](
        x, out, x.stride(0), out.stride(0), width, GELU_TANH=gelu_tanh, BLOCK=block
    )
    return out
