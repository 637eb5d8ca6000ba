"""Attention over the paged KV cache, for batches that mix prefill chunks and decodes.

The runner orders a step's tokens decodes-first. Decodes are grouped by context length (the
runner sorts them into a few buckets so padding stays small) and each bucket is one batched
call over its gathered blocks. Each prefill chunk gets its own call (a step holds few of them);
a chunk that starts at position 0 attends to its own fresh K/V and needs no gather at all.

The cache is head-major ([2, KVH, blocks, bs, D] per layer), so an index_select of blocks gives
each (request, KV head) a contiguous [tokens, D] matrix. For decodes the query heads that share
a KV head are folded into the query-length dimension ([B, KVH, group, D]), so grouped-query
attention needs no expansion of K and V.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class DecodeBucket:
    rows: torch.Tensor  # [b] positions of these decodes among the step's first tokens
    block_ids: torch.Tensor  # [b * max_blocks] long: each decode's blocks, padded with block 0
    max_blocks: int
    mask: torch.Tensor  # [b, 1, 1, max_blocks * block_size] bool: True = attend


@dataclass
class PrefillSpan:
    query_start: int  # offset of the chunk's tokens in the step's flat batch
    num_tokens: int
    start_pos: int  # position of the chunk's first token in its sequence
    block_ids: torch.Tensor  # [n] long: blocks covering positions [0, start_pos + num_tokens)
    mask: torch.Tensor | None = None  # [num_tokens, ctx_len] bool; None when start_pos == 0 (plain causal)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of every token in the step
    num_decode_tokens: int = 0  # the first tokens of the batch are decodes, one per request
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] (already written to the cache); kv_layer: [2, KVH, blocks, bs, D].

    Returns [T, H, D].
    """
    out = torch.empty_like(q)
    for bucket in meta.decode_buckets:
        out[bucket.rows] = _decode_attention(q.index_select(0, bucket.rows), kv_layer, bucket, scale)
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.num_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_layer, span, scale)
    return out


def _decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, bucket: DecodeBucket, scale: float) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[1]
    keys = _gather(kv_layer[0], bucket.block_ids).view(num_kv_heads, batch, -1, head_dim).transpose(0, 1)
    values = _gather(kv_layer[1], bucket.block_ids).view(num_kv_heads, batch, -1, head_dim).transpose(0, 1)
    grouped_q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=bucket.mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _prefill_attention(q, k, v, kv_layer, span: PrefillSpan, scale: float) -> torch.Tensor:
    if span.start_pos == 0:
        keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
    else:
        ctx_len = span.start_pos + span.num_tokens
        keys = _gather(kv_layer[0], span.block_ids).flatten(1, 2)[:, :ctx_len]
        values = _gather(kv_layer[1], span.block_ids).flatten(1, 2)[:, :ctx_len]
        mask, causal = span.mask, False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, Tq, D]
        keys.unsqueeze(0),  # [1, KVH, Tk, D]
        values.unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache: [KVH, blocks, bs, D] -> [KVH, n, bs, D] (index_select: far faster than advanced indexing)."""
    return cache.index_select(1, block_ids)
