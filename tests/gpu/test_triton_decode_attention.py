"""The Triton decode attention (layers/triton_attention.py) equals the torch path (gather + SDPA) on
scattered block tables, every grouped-query shape the models have, and contexts that end inside
a block, on a tile edge, and past several tiles."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.layers.attention import DecodeBatch, decode_attention, select_decode_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("triton", reason="the Triton kernels need Triton (make setup installs it)")
from disagg.engine.layers.triton_attention import paged_decode_attention  # noqa: E402

SHAPES = [  # (query heads, KV heads, head dim): tiny, SmolLM2, Llama-3-8B, no grouping
    (8, 2, 8),
    (9, 3, 64),
    (32, 8, 128),
    (4, 4, 16),
]
CONTEXTS = [1, 15, 16, 17, 64, 65, 300, 1000]


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_triton_decode_equals_the_torch_path(heads, kv_heads, head_dim, dtype, tolerance):
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    block_size, num_blocks = 16, 512
    kv = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, device="cuda", generator=g).to(dtype)
    lens = torch.tensor(CONTEXTS, dtype=torch.int32, device="cuda")
    width = -(-max(CONTEXTS) // block_size)
    order = torch.randperm(num_blocks, device="cuda", generator=g)
    tables = torch.stack([order.roll(17 * i)[:width] for i in range(len(CONTEXTS))]).to(torch.int32)
    q = torch.randn(len(CONTEXTS), heads, head_dim, device="cuda", generator=g).to(dtype)
    scale = head_dim**-0.5
    got = paged_decode_attention(q, kv, tables, lens, scale)
    expected = decode_attention(q, kv, DecodeBatch(tables, lens, block_size, None), scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_the_engine_takes_the_triton_kernel_on_cuda_unless_told_torch():
    device = torch.device("cuda")
    assert select_decode_kernel(device, "auto") is paged_decode_attention
    assert select_decode_kernel(device, "torch") is None


@pytest.mark.parametrize("window", [1, 16, 48, 100, 4096])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_triton_decode_attends_to_the_sliding_window_only(heads, kv_heads, head_dim, window):
    """A windowed layer: equal to the torch path's window, and the blocks before each window
    (NaN here, as a freed block's place) are never read."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(window)
    block_size, num_blocks = 16, 512
    kv = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, device="cuda", generator=g)
    lens = torch.tensor(CONTEXTS, dtype=torch.int32, device="cuda")
    width = -(-max(CONTEXTS) // block_size)
    order = torch.randperm(num_blocks, device="cuda", generator=g)
    tables = torch.stack([order.roll(17 * i)[:width] for i in range(len(CONTEXTS))]).to(torch.int32)
    q = torch.randn(len(CONTEXTS), heads, head_dim, device="cuda", generator=g)
    expected = decode_attention(q, kv, DecodeBatch(tables, lens, block_size, None), head_dim**-0.5, window)
    keep = torch.zeros(num_blocks, dtype=torch.bool, device="cuda")
    for row, n in enumerate(CONTEXTS):
        keep[tables[row, max(0, n - window) // block_size : -(-n // block_size)].long()] = True
    poisoned = kv.masked_fill(~keep.view(1, 1, -1, 1, 1), float("nan"))
    got = paged_decode_attention(q, poisoned, tables, lens, head_dim**-0.5, window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
