"""Sliding-window attention on every path attention runs on the CPU: the C++ decode kernel (fast
and generic shapes, float32 and bfloat16), the bucketed torch decode path, and prefill chunks
(at position 0 and after earlier chunks), each against a plain reference that masks a full
gather; and each reads only the blocks its window needs (the blocks before it are NaN here)."""

from __future__ import annotations

import pytest
import torch

from disagg.config import EngineConfig
from disagg.engine.layers import cpu_kernels
from disagg.engine.layers.attention import (
    AttentionMetadata,
    DecodeBatch,
    PrefillSpan,
    decode_attention,
    paged_attention,
)
from disagg.engine.model_config import ModelConfig

BLOCK_SIZE = 16
NUM_BLOCKS = 160


@pytest.fixture(scope="module")
def kernel():
    backend = EngineConfig().attention_backend
    fn = None if backend == "torch" else cpu_kernels.decode_kernel(torch.device("cpu"), backend)
    if fn is None:
        pytest.skip("the C++ decode kernel is off or could not be built here")
    return fn


def _cache(num_kv_heads, head_dim, dtype, seed, block_size=BLOCK_SIZE):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_kv_heads, NUM_BLOCKS, block_size, head_dim, generator=gen).to(dtype), gen


def _tables(lens, gen, block_size=BLOCK_SIZE):
    width = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for row, n in enumerate(lens):
        tables[row, : -(-n // block_size)] = torch.randperm(NUM_BLOCKS, generator=gen)[: -(-n // block_size)].int()
    return tables


def _keys(kv_layer, table, n):
    block_size = kv_layer.shape[3]
    blocks = table[: -(-n // block_size)].long()
    keys = kv_layer[0].index_select(1, blocks).flatten(1, 2)[:, :n].float()
    return keys, kv_layer[1].index_select(1, blocks).flatten(1, 2)[:, :n].float()


def _reference(q, kv_layer, table, positions, window, scale):
    """Queries at `positions` (one request), each over keys (p - window, p], from a full gather."""
    keys, values = _keys(kv_layer, table, max(positions) + 1)
    pos = torch.tensor(positions).unsqueeze(1)
    k_pos = torch.arange(keys.shape[1]).unsqueeze(0)
    mask = (k_pos <= pos) & (k_pos > pos - (window or 10**9))
    query = q.float().transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _poison_before_windows(kv_layer, tables, lens, window, block_size=BLOCK_SIZE, firsts=None):
    """NaN in every block a request's window does not reach (a freed block's place), and in
    every block no request holds: a path that reads one of them returns NaN. `firsts`: each
    request's first position in its window (default: its last position's)."""
    keep = torch.zeros(NUM_BLOCKS, dtype=torch.bool)
    for row, n in enumerate(lens):
        first = firsts[row] if firsts else max(0, n - window)
        keep[tables[row, first // block_size : -(-n // block_size)].long()] = True
    return kv_layer.masked_fill(~keep.view(1, 1, -1, 1, 1), float("nan"))


# ---- decode ---------------------------------------------------------------------------------------
DECODE_CASES = {
    # name: (context lengths, KV heads, group, head dim): fast path (64, 128) and the generic one (80)
    "fast-d64": ([1, 5, 16, 17, 33, 48, 49, 200, 511], 3, 3, 64),
    "fast-d128": ([2, 40, 127, 300], 2, 4, 128),
    "generic-d80": ([15, 48, 100, 301], 2, 3, 80),
    "generic-group9": ([3, 40, 77], 2, 9, 64),
}
WINDOWS = [1, 7, 16, 32, 48, 100, 4096]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_the_kernel_attends_to_the_window_only(kernel, case, dtype, window):
    lens, num_kv_heads, group, head_dim = DECODE_CASES[case]
    kv_layer, gen = _cache(num_kv_heads, head_dim, dtype, seed=window)
    tables = _tables(lens, gen)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    poisoned = _poison_before_windows(kv_layer, tables, lens, window)
    got = kernel(q, poisoned, tables, context_lens, 0.1, window)
    for row, n in enumerate(lens):
        expected = _reference(q[row : row + 1], kv_layer, tables[row], [n - 1], window, 0.1)
        torch.testing.assert_close(got[row : row + 1], expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("block_size", [8, 32])
def test_the_kernel_window_with_other_block_sizes(kernel, block_size):
    lens, window = [1, 9, 31, 32, 33, 300], 20
    kv_layer, gen = _cache(3, 64, torch.float32, seed=block_size, block_size=block_size)
    tables = _tables(lens, gen, block_size)
    q = torch.randn(len(lens), 9, 64, generator=gen)
    got = kernel(q, kv_layer, tables, torch.tensor(lens, dtype=torch.int32), 0.125, window)
    for row, n in enumerate(lens):
        expected = _reference(q[row : row + 1], kv_layer, tables[row], [n - 1], window, 0.125)
        torch.testing.assert_close(got[row : row + 1], expected, rtol=1e-5, atol=2e-6)


def test_window_zero_is_no_window(kernel):
    kv_layer, gen = _cache(2, 64, torch.float32, seed=3)
    lens = [5, 70, 300]
    tables, q = _tables(lens, gen), torch.randn(3, 4, 64, generator=gen)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    assert torch.equal(
        kernel(q, kv_layer, tables, context_lens, 0.1, 0), kernel(q, kv_layer, tables, context_lens, 0.1)
    )


@pytest.mark.parametrize("window", [7, 32, 48, 100])
def test_the_torch_decode_path_attends_to_the_window_only(window):
    """The bucketed torch path (more decodes than a bucket holds) gathers from each window's
    first block: the blocks before it may be NaN."""
    lens = [3, 700, 16, 17, 250, 1, 90, 333, 64, 65, 128, 400, 12, 5, 600, 31, 200, 47]
    kv_layer, gen = _cache(3, 64, torch.float32, seed=window)
    tables = _tables(lens, gen)
    q = torch.randn(len(lens), 9, 64, generator=gen)
    batch = DecodeBatch(tables, torch.tensor(lens, dtype=torch.int32), BLOCK_SIZE, None)
    got = decode_attention(q, _poison_before_windows(kv_layer, tables, lens, window), batch, 0.1, window)
    for row, n in enumerate(lens):
        expected = _reference(q[row : row + 1], kv_layer, tables[row], [n - 1], window, 0.1)
        torch.testing.assert_close(got[row : row + 1], expected, rtol=1e-5, atol=2e-6)
    assert set(batch._buckets) == {window}, "buckets are built once per window"


# ---- prefill chunks -------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [1, 16, 40, 300])
@pytest.mark.parametrize("start,num_tokens", [(0, 100), (0, 30), (64, 50), (90, 1), (200, 37)])
def test_a_prefill_chunk_attends_to_its_window_only(window, start, num_tokens):
    """One chunk of a prompt (its earlier positions already in the cache): the SDPA mask and
    the blocks gathered follow the window."""
    kv_layer, gen = _cache(2, 32, torch.float32, seed=start + window)
    end = start + num_tokens
    table = _tables([end], gen)[0]
    q = torch.randn(num_tokens, 6, 32, generator=gen)
    keys, values = _keys(kv_layer, table, end)
    k, v = keys[:, start:].transpose(0, 1), values[:, start:].transpose(0, 1)  # the chunk's own K/V
    span = _span(start, num_tokens, table)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), prefills=[span])
    first_query_window = max(0, start - window + 1)
    poisoned = _poison_before_windows(kv_layer, table.unsqueeze(0), [end], window, firsts=[first_query_window])
    got = paged_attention(q, k, v, poisoned, meta, 0.2, window)
    expected = _reference(q, kv_layer, table, list(range(start, end)), window, 0.2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


def _span(start, num_tokens, table):
    end = start + num_tokens
    mask = None
    if start:
        mask = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
    return PrefillSpan(0, num_tokens, start, table[: -(-end // BLOCK_SIZE)].long(), mask)


# ---- the model's windows --------------------------------------------------------------------------
def _config(**fields) -> ModelConfig:
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4)
    shape.update(num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return ModelConfig(architecture="llama", **{**shape, **fields})


def test_layer_windows_and_groups():
    mixed = _config(sliding_window=48, layer_types=("sliding_attention",) * 3 + ("full_attention",))
    assert [mixed.attention_window(i) for i in range(4)] == [48, 48, 48, None]
    assert [(g.window, g.layers) for g in mixed.layer_groups] == [(None, (3,)), (48, (0, 1, 2))]
    plain = _config(sliding_window=48)  # a window but no layer that slides: all global
    assert [(g.window, g.layers) for g in plain.layer_groups] == [(None, (0, 1, 2, 3))]


@pytest.mark.parametrize(
    "fields,error",
    [
        (dict(layer_types=("full_attention",) * 3), "3 entries for 4 layers"),
        (dict(layer_types=("chunked_attention",) * 4, sliding_window=8), "unsupported"),
        (dict(layer_types=("sliding_attention",) * 4), "sliding_window: a positive"),
        (dict(layer_types=("sliding_attention",) * 4, sliding_window=0), "sliding_window: a positive"),
    ],
)
def test_bad_layer_windows_are_refused(fields, error):
    with pytest.raises(ValueError, match=error):
        _config(**fields)
