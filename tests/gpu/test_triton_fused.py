"""The compiled Triton kernels of triton_fused.py on a GPU equal the torch code they replace
(tests/unit/triton_kernel_cases.py checks the same under the interpreter on CPU), and the engine
chooses them on CUDA unless told `torch`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg.engine.kv_cache import KVCache
from disagg.engine.layers import gpu_kernels
from disagg.engine.layers.norm import RMSNorm
from disagg.engine.layers.rotary import RotaryEmbedding, apply_rotary

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("triton", reason="the Triton kernels need Triton (make setup installs it)")
from disagg.engine.layers import triton_fused  # noqa: E402

DEVICE = torch.device("cuda")
TOLERANCE = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}
DTYPES = [torch.float32, torch.bfloat16]


def _random(shape, dtype, gen, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=DEVICE) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (33, 4096)])
def test_rms_norm(dtype, unit_offset, rows, hidden):
    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    norm = RMSNorm(hidden, 1e-5, unit_offset).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(_random(hidden, dtype, gen))
    x, residual = _random((rows, hidden), dtype, gen, 3.0), _random((rows, hidden), dtype, gen, 3.0)
    for res in (None, residual):
        out, new_residual = triton_fused.rms_norm(x, res, norm.weight, norm.eps, unit_offset)
        expected, expected_residual = norm(x, res)
        torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])
        assert torch.equal(new_residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 128)])
def test_rotary_with_the_kv_write(dtype, heads, kv_heads, head_dim):
    gen = torch.Generator(device=DEVICE).manual_seed(heads)
    tokens = 37
    qkv = _random((tokens, heads + 2 * kv_heads, head_dim), dtype, gen)
    positions = torch.randint(0, 4000, (tokens,), generator=gen, device=DEVICE)
    cos, sin = RotaryEmbedding(head_dim, 4096, 500000.0).cos_sin(positions, dtype)
    expected_qk = apply_rotary(qkv[:, : heads + kv_heads], cos, sin)
    expected_cache, cache = (KVCache(1, 16, 16, kv_heads, head_dim, dtype, DEVICE) for _ in range(2))
    slots = torch.randperm(256, generator=gen, device=DEVICE)[:tokens]
    v = qkv[:, heads + kv_heads :]
    expected_cache.write(0, slots, expected_qk[:, heads:], v)
    qk = qkv[:, : heads + kv_heads]
    triton_fused.rotary_kv_write(qk, v, cos, sin, cache.layer(0), slots, heads)
    torch.testing.assert_close(qk.float(), expected_qk.float(), **TOLERANCE[dtype])
    assert torch.equal(cache.tensor, expected_cache.tensor)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gelu_tanh", [False, True])
def test_gated_activations(dtype, gelu_tanh):
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    gate_up = _random((17, 2 * 14336), dtype, gen, 3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu_tanh else F.silu(gate)
    got = triton_fused.gated_activation(gate_up, gelu_tanh)
    torch.testing.assert_close(got.float(), (act * up).float(), **TOLERANCE[dtype])


def test_the_engine_takes_them_on_cuda_unless_told_torch():
    assert gpu_kernels.fused_ops(DEVICE, "auto") is triton_fused
    assert gpu_kernels.fused_ops(DEVICE, "torch") is None
    assert gpu_kernels.fused_ops(torch.device("cpu"), "auto") is None
