"""Attention over the paged KV cache, for batches that mix prefill chunks and decodes.

The runner orders a step's tokens decodes-first. All decodes are one call: a kernel reads each
request's K/V blocks in place through its block table (on CPU the C++ one, cpu_kernels.py; on
CUDA the Triton one, gpu_kernels.py); where neither runs, the torch path gathers the blocks and
runs SDPA, over a few buckets of similar context length so that padding stays small. Each prefill chunk gets its own
call (a step holds few of them); a chunk that starts at position 0 attends to its own fresh K/V
and needs no gather at all.

On CPU a prefill chunk's rows get the same numbers however its prompt was cut into chunks (which
depends on what else its steps held: the budget they left), so that a request's first token does
not depend on how busy the engine is. Torch's CPU SDPA sums a row over blocks of 512 keys and
takes queries in blocks of 32, 64 or 256, and a block's sums depend on its width, and a block of
1 to 3 queries takes another path: so every chunk reads its keys from the cache up to a whole
number of 512-key blocks, masked past its own (their products exact zeros), and its queries are
padded to a multiple of 32 (a copy of its last row). The cost is that padding: at most 511 keys
and 31 queries more per chunk and layer (loadtest/results/batch_invariance.md).

A sliding-window layer passes its window W: each query then attends to its last W positions, its
own included (HF's `kv_idx > q_idx - W`), and every path reads only the blocks that hold them
(the kernels start at the window; the torch paths gather from its first block on), so a block
that fell out of the window is never read. The step's metadata does not depend on the layer:
each path derives what a window needs from it, once per step and window (masks, shifted tables).

The cache is head-major ([2, KVH, blocks, bs, D] per layer): each block of one KV head is a
contiguous [bs, D] matrix, and an index_select of blocks gives each (request, KV head) a
contiguous [tokens, D] matrix. The query heads that share a KV head are computed together
([B, KVH, group, D]), so grouped-query attention needs no expansion of K and V.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from disagg.engine.layers import cpu_kernels, gpu_kernels
from disagg.engine.layers.cpu_kernels import DecodeKernel

# CPU prefill chunks: torch's SDPA's key and query block sizes (see above; the test of chunked and
# whole prompts checks that they still hold).
SDPA_KEY_TILE = 512
SDPA_QUERY_TILE = 32
# Torch path: buckets of decodes by context length, enough to cut padding, few enough that
# per-call overhead stays small.
MAX_DECODE_BUCKETS = 4
MIN_DECODES_PER_BUCKET = 8


@dataclass
class DecodeBucket:
    rows: torch.Tensor  # [b] positions of these decodes among the step's first tokens
    block_ids: (
        torch.Tensor
    )  # [b * max_blocks] long: each decode's blocks (from its window's first), padded with block 0
    mask: torch.Tensor  # [b, 1, 1, max_blocks * block_size] bool: True = attend


@dataclass
class DecodeBatch:
    """The step's decodes: its first rows, one query token each."""

    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    context_lens: torch.Tensor  # [B] int32: tokens each decode attends to (its position + 1)
    block_size: int
    kernel: DecodeKernel | None = None  # None: the torch path
    _buckets: dict[int | None, list[DecodeBucket]] = field(default_factory=dict, repr=False)

    def buckets(self, window: int | None = None) -> list[DecodeBucket]:
        """The torch path's inputs, built once per step and window: decodes sorted by the
        length they attend to, split into a few equal-count buckets, each padded only to its
        own longest."""
        if window not in self._buckets:
            self._buckets[window] = _decode_buckets(self.block_tables, self.context_lens, self.block_size, window)
        return self._buckets[window]


@dataclass
class PrefillSpan:
    query_start: int  # offset of the chunk's tokens in the step's flat batch
    num_tokens: int
    start_pos: int  # position of the chunk's first token in its sequence
    block_ids: torch.Tensor  # [n] long: blocks covering positions [0, start_pos + num_tokens)
    mask: torch.Tensor | None = None  # [num_tokens, ctx_len] bool; None when start_pos == 0 (plain causal)
    _windowed: dict[int, "WindowedKeys"] = field(default_factory=dict, repr=False)
    _tiled_mask: torch.Tensor | None = field(default=None, repr=False)

    def tiled_mask(self) -> torch.Tensor:
        """[queries padded to SDPA_QUERY_TILE, keys padded to SDPA_KEY_TILE] bool, True = attend:
        the chunk's causal mask on CPU (_tiled_prefill_attention), built once per step."""
        if self._tiled_mask is None:
            end = self.start_pos + self.num_tokens
            queries = torch.arange(self.start_pos, end + -self.num_tokens % SDPA_QUERY_TILE).clamp_max(end - 1)
            keys = torch.arange(-(-end // SDPA_KEY_TILE) * SDPA_KEY_TILE)
            self._tiled_mask = (keys.unsqueeze(0) <= queries.unsqueeze(1)).to(self.block_ids.device)
        return self._tiled_mask

    def windowed(self, window: int, block_size: int) -> "WindowedKeys":
        """What a layer of sliding window `window` reads, built once per step and window."""
        if window not in self._windowed:
            self._windowed[window] = _windowed_keys(self, window, block_size)
        return self._windowed[window]


@dataclass
class WindowedKeys:
    """A prefill chunk's keys under a sliding window: from the block holding its first query's
    window start on."""

    first_block: int  # index into the span's blocks of the first one read
    mask: torch.Tensor  # [num_tokens, keys from first_block * block_size to the chunk's end] bool


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of every token in the step
    num_decode_tokens: int = 0  # the first tokens of the batch are decodes, one per request
    # Of those, the leading ones that decode a generated token: a quantized GEMM takes its kernel
    # for their rows (layers/quantized.py); None outside an engine step (by count).
    decode_rows: int | None = None
    decode: DecodeBatch | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)


def select_decode_kernel(device: torch.device, backend: str) -> DecodeKernel | None:
    """The decode kernel for this device and EngineConfig.attention_backend (None: the torch path)."""
    if device.type == "cuda":
        return gpu_kernels.decode_kernel(device, backend)
    return cpu_kernels.decode_kernel(device, backend)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] (already written to the cache); kv_layer: [2, KVH, blocks, bs, D];
    window: the layer's sliding window (None: it attends to every earlier position).

    Returns [T, H, D].
    """
    if meta.decode is not None and not meta.prefills:  # a decode-only step: no scatter into `out`
        return decode_attention(q, kv_layer, meta.decode, scale, window)
    out = torch.empty_like(q)
    if meta.decode is not None:
        n = meta.num_decode_tokens
        out[:n] = decode_attention(q[:n], kv_layer, meta.decode, scale, window)
    for span in meta.prefills:
        rows = slice(span.query_start, span.query_start + span.num_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_layer, span, scale, window)
    return out


def decode_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, decode: DecodeBatch, scale: float, window: int | None = None
) -> torch.Tensor:
    """q: [B, H, D], one token per decode -> [B, H, D]."""
    if decode.kernel is not None:
        return decode.kernel(q, kv_layer, decode.block_tables, decode.context_lens, scale, window or 0)
    out = torch.empty_like(q)
    for bucket in decode.buckets(window):
        out[bucket.rows] = _decode_bucket_attention(q.index_select(0, bucket.rows), kv_layer, bucket, scale)
    return out


def _decode_bucket_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, bucket: DecodeBucket, scale: float
) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[1]
    keys = _gather(kv_layer[0], bucket.block_ids).view(num_kv_heads, batch, -1, head_dim).transpose(0, 1)
    values = _gather(kv_layer[1], bucket.block_ids).view(num_kv_heads, batch, -1, head_dim).transpose(0, 1)
    grouped_q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=bucket.mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _decode_buckets(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, window: int | None
) -> list[DecodeBucket]:
    lens = context_lens.tolist()
    # Under a window each decode reads from the block holding its window's first position on.
    firsts = [max(0, n - window) // block_size if window else 0 for n in lens]
    spans = [-(-n // block_size) - first for n, first in zip(lens, firsts)]  # blocks read
    order = sorted(range(len(lens)), key=spans.__getitem__)
    num_buckets = min(MAX_DECODE_BUCKETS, -(-len(lens) // MIN_DECODES_PER_BUCKET))
    buckets = []
    for b in range(num_buckets):
        rows = order[b * len(order) // num_buckets : (b + 1) * len(order) // num_buckets]
        buckets.append(_decode_bucket(block_tables, context_lens, block_size, window, rows, firsts, spans[rows[-1]]))
    return buckets


def _decode_bucket(block_tables, context_lens, block_size, window, rows, firsts, max_blocks) -> DecodeBucket:
    device = block_tables.device
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)
    first = torch.tensor([firsts[r] for r in rows], dtype=torch.long, device=device).unsqueeze(1)
    lens = context_lens.index_select(0, rows_t).unsqueeze(1)
    # Padding columns repeat the decode's own last block (masked out): never a block it does not hold.
    last = (lens.long() - 1) // block_size
    columns = torch.minimum(first + torch.arange(max_blocks, device=device), last)
    block_ids = block_tables.index_select(0, rows_t).gather(1, columns).reshape(-1).long()
    positions = first * block_size + torch.arange(max_blocks * block_size, device=device)  # [b, keys]
    mask = positions < lens
    if window:
        mask &= positions >= lens - window
    return DecodeBucket(rows_t, block_ids, mask.view(len(rows), 1, 1, -1))


def _prefill_attention(q, k, v, kv_layer, span: PrefillSpan, scale: float, window: int | None) -> torch.Tensor:
    binds = window is not None and span.start_pos + span.num_tokens > window  # else the window never binds
    if q.device.type == "cpu" and not binds:
        return _tiled_prefill_attention(q, kv_layer, span, scale)
    return _untiled_prefill_attention(q, k, v, kv_layer, span, scale, window)


def _untiled_prefill_attention(q, k, v, kv_layer, span: PrefillSpan, scale: float, window: int | None):
    """Plain SDPA: a chunk at position 0 over its own fresh keys, causal; a later one over the cache."""
    if window is not None and span.start_pos + span.num_tokens > window:
        keys, values, mask = _windowed_prefill_keys(k, v, kv_layer, span, window)
        causal = False
    elif span.start_pos == 0:
        keys, values, mask, causal = k.transpose(0, 1), v.transpose(0, 1), None, True
    else:
        ctx_len = span.start_pos + span.num_tokens
        keys = _gather(kv_layer[0], span.block_ids).flatten(1, 2)[:, :ctx_len]
        values = _gather(kv_layer[1], span.block_ids).flatten(1, 2)[:, :ctx_len]
        mask, causal = span.mask, False
    return _sdpa(q, keys, values, mask, causal, scale)


def _tiled_prefill_attention(q, kv_layer, span: PrefillSpan, scale: float) -> torch.Tensor:
    """A chunk's rows computed alike however its prompt is chunked (the module's docstring)."""
    mask = span.tiled_mask()
    end = span.start_pos + span.num_tokens
    keys, values = (_padded_cache_rows(kv_layer[i], span.block_ids, end, mask.shape[1]) for i in (0, 1))
    padding = mask.shape[0] - span.num_tokens
    rows = torch.cat([q, q[-1:].expand(padding, -1, -1)]) if padding else q
    return _sdpa(rows, keys, values, mask, False, scale)[: span.num_tokens]


def _padded_cache_rows(cache: torch.Tensor, block_ids: torch.Tensor, end: int, width: int) -> torch.Tensor:
    """Positions [0, end) of one sequence's cached keys or values, [KVH, width, D], zeros past
    `end` (a block's slots past it may hold anything, NaN included, which a zero weight would
    not cancel)."""
    rows = _gather(cache, block_ids).flatten(1, 2)[:, :end]
    return F.pad(rows, (0, 0, 0, width - end))


def _windowed_prefill_keys(k, v, kv_layer, span: PrefillSpan, window: int):
    """(keys, values, mask) of a chunk under a sliding window: its own fresh K/V when the chunk
    starts the sequence, else the cached blocks from its first query's window on."""
    block_size = kv_layer.shape[3]
    read = span.windowed(window, block_size)
    if span.start_pos == 0:
        return k.transpose(0, 1), v.transpose(0, 1), read.mask
    ctx_len = span.start_pos + span.num_tokens - read.first_block * block_size
    block_ids = span.block_ids[read.first_block :]
    keys = _gather(kv_layer[0], block_ids).flatten(1, 2)[:, :ctx_len]
    values = _gather(kv_layer[1], block_ids).flatten(1, 2)[:, :ctx_len]
    return keys, values, read.mask


def _windowed_keys(span: PrefillSpan, window: int, block_size: int) -> WindowedKeys:
    """Query i (position start_pos + i) attends to key positions p with p <= its own and
    p > its own - window; a chunk at position 0 reads its own keys, others the blocks from the
    one holding the first query's window start."""
    device = span.block_ids.device
    first_block = 0 if span.start_pos == 0 else max(0, span.start_pos - window + 1) // block_size
    end = span.start_pos + span.num_tokens
    queries = torch.arange(span.start_pos, end, device=device).unsqueeze(1)
    keys = torch.arange(first_block * block_size, end, device=device).unsqueeze(0)
    return WindowedKeys(first_block, (keys <= queries) & (keys > queries - window))


def _sdpa(q, keys, values, mask, causal: bool, scale: float) -> torch.Tensor:
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
