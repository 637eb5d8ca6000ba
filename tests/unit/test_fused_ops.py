"""The fused C++ RMSNorm and rotary ops equal the torch versions; the wrappers fall back where they
do not apply (bfloat16, the attention backend `torch`)."""

from __future__ import annotations

import pytest
import torch

from disagg.config import EngineConfig
from disagg.engine.layers import cpu_kernels
from disagg.engine.layers.fused import FusedRMSNorm, Rotary
from disagg.engine.layers.norm import RMSNorm
from disagg.engine.layers.rotary import RotaryEmbedding, apply_rotary


@pytest.fixture(scope="module")
def ops():
    backend = EngineConfig().attention_backend  # as configured (DISAGG_ATTENTION_BACKEND)
    if backend == "torch":
        pytest.skip("attention backend torch: the kernels are switched off")
    ops = cpu_kernels.cpu_ops(torch.device("cpu"), backend)
    if ops is None:
        pytest.skip("the CPU kernels could not be built on this machine (no compiler?)")
    return ops


def _norm(hidden: int, seed: int) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)))
    return norm


@pytest.mark.parametrize("rows", [1, 32, 513])
def test_rms_norm_matches_torch(ops, rows):
    gen = torch.Generator().manual_seed(rows)
    norm = _norm(576, rows)
    x, residual = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen)
    for res in (residual, None):
        expected_out, expected_res = norm(x, res)
        out, new_res = ops.rms_norm(x, res, norm.weight, norm.eps)
        torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_res, expected_res, rtol=0, atol=0)


def test_rms_norm_strided_rows(ops):
    norm = _norm(64, 1)
    wide = torch.randn(10, 100)
    x = wide[:, :64]  # rows 100 apart, as a split of a fused projection gives
    torch.testing.assert_close(ops.rms_norm(x, None, norm.weight, norm.eps)[0], norm(x)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 32, 300])
def test_rotary_matches_torch_on_a_split_view(ops, rows):
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(rows))
    q = qkv[:, : heads * dim].view(rows, heads, dim)  # not contiguous: rows are the qkv width apart
    positions = torch.randint(0, 2048, (rows,))
    cos, sin = RotaryEmbedding(dim, 2048, 10000.0).cos_sin(positions, torch.float32)
    torch.testing.assert_close(ops.rotary(q, cos, sin), apply_rotary(q, cos, sin), rtol=1e-6, atol=1e-6)


def test_wrappers_use_the_ops_and_fall_back(ops):
    fused, plain = FusedRMSNorm(32, 1e-6), RMSNorm(32, 1e-6)
    x, residual = torch.randn(4, 32), torch.randn(4, 32)
    torch.testing.assert_close(fused(x, residual), plain(x, residual), rtol=1e-5, atol=1e-5)
    half = FusedRMSNorm(32, 1e-6).to(torch.bfloat16)  # bfloat16: the torch code, bit for bit
    plain_half = RMSNorm(32, 1e-6).to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    assert torch.equal(half(xb)[0], plain_half(xb)[0])
    rope = Rotary("torch")
    q = torch.randn(3, 2, 8)
    cos, sin = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    assert torch.equal(rope(q, cos, sin), apply_rotary(q, cos, sin))
    assert rope._ops.get(q) is None
