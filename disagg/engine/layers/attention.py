"""Attention over the paged KV cache, for batches that mix prefill chunks and decodes.

The runner orders a step's tokens decodes-first. All decodes (one query each) share one
batched call over their gathered blocks; each prefill chunk gets its own call (a step holds
few of them, and padding a 1-token decode to a 512-token chunk would waste the compute).
A chunk that starts at position 0 attends to its own fresh K/V and needs no gather at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    query_start: int  # offset of the chunk's tokens in the step's flat batch
    num_tokens: int
    start_pos: int  # position of the chunk's first token in its sequence
    block_table: torch.Tensor  # [num_blocks] long: blocks covering positions [0, start_pos + num_tokens)
    mask: torch.Tensor | None = None  # [num_tokens, ctx_len] bool; None when start_pos == 0 (plain causal)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of every token in the step
    num_decode_tokens: int = 0  # the first tokens of the batch are decodes, one per request
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] long (padded with block 0)
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks * block_size] bool: True = attend
    prefills: list[PrefillSpan] = field(default_factory=list)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] (already written to the cache); kv_layer: [2, blocks, bs, KVH, D].

    Returns [T, H, D].
    """
    out = torch.empty_like(q)
    num_decodes = meta.num_decode_tokens
    if num_decodes:
        out[:num_decodes] = _decode_attention(q[:num_decodes], kv_layer, meta, scale)
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.num_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_layer, span, scale)
    return out


def _decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    batch = q.shape[0]
    keys = _gather(kv_layer[0], meta.decode_block_tables).view(batch, -1, *kv_layer.shape[-2:])
    values = _gather(kv_layer[1], meta.decode_block_tables).view(batch, -1, *kv_layer.shape[-2:])
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, H, 1, D]
        keys.transpose(1, 2),  # [B, KVH, L, D]
        values.transpose(1, 2),
        attn_mask=meta.decode_mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def _prefill_attention(q, k, v, kv_layer, span: PrefillSpan, scale: float) -> torch.Tensor:
    if span.start_pos == 0:
        keys, values, mask, causal = k, v, None, True
    else:
        ctx_len = span.start_pos + span.num_tokens
        keys = _gather(kv_layer[0], span.block_table).flatten(0, 1)[:ctx_len]
        values = _gather(kv_layer[1], span.block_table).flatten(0, 1)[:ctx_len]
        mask, causal = span.mask, False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, Tq, D]
        keys.transpose(0, 1).unsqueeze(0),  # [1, KVH, Tk, D]
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache: [blocks, bs, KVH, D]; block_table: [..., n] -> [..., n, bs, KVH, D]."""
    return cache[block_table]
