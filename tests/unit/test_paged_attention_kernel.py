"""The C++ decode paged-attention kernel equals the torch path (gather + SDPA) on random caches
whose blocks are scattered, for GQA ratios 1/3/4, contexts that end mid-block, and float32 and
bfloat16 caches; and the metadata the runner builds drives both paths alike."""

from __future__ import annotations

import pytest
import torch

from disagg.config import EngineConfig
from disagg.engine.layers import cpu_kernels
from disagg.errors import InvalidRequestError
from disagg.engine.layers.attention import DecodeBatch, decode_attention

BLOCK_SIZE = 16
NUM_BLOCKS = 200


@pytest.fixture(scope="module")
def kernel():
    backend = EngineConfig().attention_backend  # as configured (DISAGG_ATTENTION_BACKEND)
    if backend == "torch":
        pytest.skip("attention backend torch: the kernel is switched off")
    fn = cpu_kernels.decode_kernel(torch.device("cpu"), backend)
    if fn is None:
        pytest.skip("the paged-attention kernel could not be built on this machine (no compiler?)")
    return fn


def _random_batch(
    context_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    block_size: int = BLOCK_SIZE,
):
    """A cache with random contents and, per request, random distinct blocks in random order."""
    gen = torch.Generator().manual_seed(seed)
    kv_layer = torch.randn(2, num_kv_heads, NUM_BLOCKS, block_size, head_dim, generator=gen).to(dtype)
    width = max(-(-n // block_size) for n in context_lens)
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    for row, n in enumerate(context_lens):
        needed = -(-n // block_size)
        tables[row, :needed] = torch.randperm(NUM_BLOCKS, generator=gen)[:needed].int()
    q = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, kv_layer, tables, torch.tensor(context_lens, dtype=torch.int32)


def _reference(q, kv_layer, tables, lens, scale) -> torch.Tensor:
    """One request at a time: gather its blocks, plain float32 SDPA with GQA."""
    out = torch.empty(q.shape, dtype=torch.float32)
    block_size = kv_layer.shape[3]
    for row, n in enumerate(lens.tolist()):
        blocks = tables[row, : -(-n // block_size)].long()
        keys = kv_layer[0].index_select(1, blocks).flatten(1, 2)[:, :n].float()
        values = kv_layer[1].index_select(1, blocks).flatten(1, 2)[:, :n].float()
        query = q[row].float().unsqueeze(1).unsqueeze(0)  # [1, H, 1, D]
        out[row] = torch.nn.functional.scaled_dot_product_attention(
            query, keys.unsqueeze(0), values.unsqueeze(0), scale=scale, enable_gqa=True
        )[0, :, 0]
    return out


CASES = {
    # name: (context lengths, KV heads, group, head dim)
    "mha": ([1, 17, 200], 4, 1, 64),
    "gqa3-smollm2": ([5, 16, 33, 250, 511], 3, 3, 64),
    "gqa4-d128": ([2, 64, 127, 300], 2, 4, 128),
    "odd-head-dim": ([15, 48, 100], 2, 3, 80),
    "one-long": ([1000], 1, 4, 64),
    "group9": ([3, 40, 77], 2, 9, 64),  # more query heads per KV head than the fast path unrolls
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(kernel, case, dtype):
    lens, num_kv_heads, group, head_dim = CASES[case]
    q, kv_layer, tables, context_lens = _random_batch(lens, num_kv_heads, group, head_dim, dtype, seed=len(case))
    scale = head_dim**-0.5
    got = kernel(q.float(), kv_layer, tables, context_lens, scale)
    expected = _reference(q, kv_layer, tables, context_lens, scale)
    # Both accumulate in float32 from the same (bf16-rounded) inputs: only summation order differs.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("block_size", [8, 32])
def test_kernel_other_block_sizes(kernel, block_size):
    q, kv_layer, tables, context_lens = _random_batch(
        [1, 9, 31, 32, 33, 300], 3, 3, 64, torch.float32, seed=block_size, block_size=block_size
    )
    got = kernel(q, kv_layer, tables, context_lens, 0.125)
    torch.testing.assert_close(got, _reference(q, kv_layer, tables, context_lens, 0.125), rtol=1e-5, atol=2e-6)


def test_kernel_reads_only_the_context(kernel):
    """Every cache slot outside the requests' contexts is NaN (unused blocks, the tail of each last
    block, extra table columns as blocks allocated ahead): the result must not change."""
    q, kv_layer, tables, lens = _random_batch([20, 40, 7], 3, 3, 64, torch.float32, seed=1)
    expected = kernel(q, kv_layer, tables, lens, 0.125)
    in_context = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool)
    for row, n in enumerate(lens.tolist()):
        for pos in range(n):
            in_context[tables[row, pos // BLOCK_SIZE], pos % BLOCK_SIZE] = True
    poisoned = kv_layer.masked_fill(~in_context.view(1, 1, NUM_BLOCKS, BLOCK_SIZE, 1), float("nan"))
    unused_block = int((~in_context.any(dim=1)).nonzero()[0])
    wide = torch.cat([tables, torch.full((len(lens), 3), unused_block, dtype=torch.int32)], dim=1)
    torch.testing.assert_close(kernel(q, poisoned, wide, lens, 0.125), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_attention_kernel_and_torch_paths_agree(kernel, dtype):
    """The engine's entry point with the same metadata: kernel vs the bucketed torch path
    (more decodes than one bucket holds, so several buckets and a row permutation are exercised)."""
    lens = [3, 700, 16, 17, 250, 1, 90, 333, 64, 65, 128, 400, 12, 5, 600, 31, 200, 47]
    q, kv_layer, tables, context_lens = _random_batch(lens, 3, 3, 64, dtype, seed=5)
    scale = 0.125
    with_kernel = decode_attention(q, kv_layer, DecodeBatch(tables, context_lens, BLOCK_SIZE, kernel), scale)
    with_torch = decode_attention(q, kv_layer, DecodeBatch(tables, context_lens, BLOCK_SIZE, None), scale)
    assert with_kernel.dtype == dtype and with_torch.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(with_kernel, with_torch, **tolerance)
    torch.testing.assert_close(
        with_kernel.float(), _reference(q, kv_layer, tables, context_lens, scale).to(dtype).float(), **tolerance
    )


def test_backend_torch_forces_torch(monkeypatch):
    assert cpu_kernels.decode_kernel(torch.device("cpu"), "torch") is None
    with pytest.raises(ValueError, match="attention backend 'bogus'"):
        cpu_kernels.decode_kernel(torch.device("cpu"), "bogus")


def test_the_backend_comes_from_the_config_whose_default_is_the_environment(monkeypatch):
    monkeypatch.setenv("DISAGG_ATTENTION_BACKEND", "torch")
    assert EngineConfig().attention_backend == "torch"
    monkeypatch.setenv("DISAGG_ATTENTION_BACKEND", "bogus")
    with pytest.raises(InvalidRequestError, match="DISAGG_ATTENTION_BACKEND"):
        EngineConfig()
    monkeypatch.delenv("DISAGG_ATTENTION_BACKEND")
    assert EngineConfig().attention_backend == "auto"


def test_no_kernel_off_cpu():
    assert cpu_kernels.decode_kernel(torch.device("meta"), "auto") is None
