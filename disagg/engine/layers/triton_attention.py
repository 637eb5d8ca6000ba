"""Decode paged attention on a GPU, in Triton: one kernel per layer reads each request's K and V
blocks in place through its block table (no gather into a padded copy, no mask tensor).

One program per (request, KV head) computes every query head of that KV head's group
(grouped-query attention shares each K/V load) with an online softmax over tiles of TILE
positions: the positions of a tile map to their blocks through the block table, so a tile may
span several blocks in any order. The group's heads are padded to 16 rows for tl.dot. A
sliding-window layer (WINDOW W > 0) starts its tiles at position context - W, so the blocks
before its window are never read.

Imports Triton: reached through gpu_kernels.py, which says where it runs. Under TRITON_INTERPRET=1
(set before this module is imported) the same kernel runs on CPU tensors (tests/unit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 64  # positions per inner iteration
MIN_DOT = 16  # tl.dot's smallest dimension
NO_WINDOW = 2**31 - 1  # the kernel's window for a layer without one: every position is in it


@triton.jit
def _paged_decode(
    q_ptr, kv_ptr, tables_ptr, lens_ptr, out_ptr,
    stride_qb, stride_qh, stride_kv, stride_kh, stride_kb, stride_kt, stride_tb, stride_ob, stride_oh,
    scale, window,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(lens_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    dim_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    t = tl.arange(0, TILE)
    first = tl.maximum(ctx - window, 0)  # window: NO_WINDOW when the layer has none
    for start in range(first, ctx, TILE):
        pos = start + t
        valid = pos < ctx
        block = tl.load(tables_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
        row = kv_head * stride_kh + block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_kt
        tile_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(kv_ptr + row[:, None] + d[None, :], mask=tile_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(kv_ptr + stride_kv + row[:, None] + d[None, :], mask=tile_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / l[:, None]
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & dim_ok[None, :],
    )


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q [B, H, D]; kv_layer [2, KVH, blocks, block_size, D]; block_tables [B, n] int32;
    context_lens [B] int32 (each >= 1); window: the last `window` positions only (0: all)
    -> [B, H, D] in q's dtype."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_layer.shape[1], kv_layer.shape[3]
    if q.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("paged_decode_attention: the head dimension must be contiguous")
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    _paged_decode[(batch, num_kv_heads)](
        q, kv_layer, block_tables, context_lens, out,
        q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale, window if window > 0 else NO_WINDOW,
        GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, DIM_PAD=max(MIN_DOT, triton.next_power_of_2(head_dim)), TILE=TILE,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
