"""The cases of test_triton_kernels.py, run by it in a process with TRITON_INTERPRET=1 (this
file's name keeps the suite from collecting it itself):

    TRITON_INTERPRET=1 python -m pytest -q tests/unit/triton_kernel_cases.py

Each Triton kernel runs on CPU tensors and is compared with the torch code it replaces on CUDA.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from disagg import LLM, SamplingParams
from disagg.engine.kv_cache import KVCache
from disagg.engine.layers.fused import _LazyOps
from disagg.engine.layers.attention import DecodeBatch, decode_attention
from disagg.engine.layers.norm import RMSNorm
from disagg.engine.layers.rotary import RotaryEmbedding, apply_rotary

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "set TRITON_INTERPRET=1 before Triton is imported (test_triton_kernels.py does)", allow_module_level=True
    )

DTYPES = [torch.float32, torch.bfloat16]
# bfloat16: one unit in the last place (values rounded once more or less than torch rounds them)
TOLERANCE = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}


# ---- in the interpreter's process ------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernels():
    """(triton_attention, triton_fused), with the interpreter's gaps filled (fill_interpreter_gaps)."""
    from triton.runtime import interpreter

    with pytest.MonkeyPatch.context() as patch:
        fill_interpreter_gaps(patch, interpreter)
        from disagg.engine.layers import triton_attention, triton_fused

        yield triton_attention, triton_fused


def fill_interpreter_gaps(patch: pytest.MonkeyPatch, interpreter) -> None:
    """Three ways Triton 3.6.0's interpreter computes other than a GPU does, none of which our
    kernels' compiled code has: a loop bound loaded from memory fails under numpy >= 2.4 (int() of
    a one-element array: triton-lang/triton#9171, fixed after 3.6.0); tl.dot of bfloat16 operands
    multiplies their raw bits (it holds bfloat16 as uint16); and a float32 -> bfloat16 cast
    truncates, where a GPU rounds to nearest even."""
    import triton.language as tl

    patch_lang_tensor, create_dot, cast_impl = (
        interpreter._patch_lang_tensor,
        interpreter.InterpreterBuilder.create_dot,
        interpreter.InterpreterBuilder.cast_impl,
    )

    def patched_lang_tensor(tensor, scope):
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << np.uint32(16)
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def dot(self, a, b, *rest):
        return create_dot(self, widened(a), widened(b), *rest)

    def cast(self, src, dst_type):
        if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
            return cast_impl(self, src, dst_type)
        bits = src.data.astype(np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        return interpreter.TensorHandle(rounded.astype(np.uint16), dst_type.scalar)

    patch.setattr(interpreter, "_patch_lang_tensor", patched_lang_tensor)
    patch.setattr(interpreter.InterpreterBuilder, "create_dot", dot)
    patch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast)


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == expected.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])


def _random(shape, dtype, gen, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


# ---- RMSNorm ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (33, 576)])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_with_and_without_the_residual(kernels, dtype, rows, hidden, unit_offset):
    gen = torch.Generator().manual_seed(rows * hidden)
    norm = RMSNorm(hidden, 1e-5, unit_offset).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_random(hidden, dtype, gen))
    x, residual = _random((rows, hidden), dtype, gen, 3.0), _random((rows, hidden), dtype, gen, 3.0)
    for res in (None, residual):
        out, new_residual = kernels[1].rms_norm(x, res, norm.weight, norm.eps, unit_offset)
        expected_out, expected_residual = norm(x, res)
        _close(out, expected_out, dtype)
        assert torch.equal(new_residual, expected_residual)  # the sum, rounded as torch rounds it


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_each_head_of_a_split_projection(kernels, dtype):
    """q's heads of a fused qkv output (rows strided by the whole width): the per-head norm of
    Qwen3 and Gemma 3."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim = 4, 2, 32
    qkv = _random((6, (heads + 2 * kv_heads) * dim), dtype, gen).view(6, heads + 2 * kv_heads, dim)
    q = qkv[:, :heads]
    norm = RMSNorm(dim, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_random(dim, dtype, gen))
    out, _ = kernels[1].rms_norm(q, None, norm.weight, norm.eps)
    _close(out, norm(q)[0], dtype)


# ---- rotary + KV write ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (6, 2, 32), (9, 3, 64)])
@pytest.mark.parametrize("tokens", [1, 7])
def test_rotary_with_the_kv_write(kernels, dtype, heads, kv_heads, head_dim, tokens):
    """q and k rotated in place on a split view of qkv, and k and v at their slots in the cache:
    what apply_rotary then KVCache.write leave."""
    gen = torch.Generator().manual_seed(heads * tokens)
    qkv = _random((tokens, heads + 2 * kv_heads, head_dim), dtype, gen)
    positions = torch.randint(0, 500, (tokens,), generator=gen)
    cos, sin = RotaryEmbedding(head_dim, 512, 10000.0).cos_sin(positions, dtype)
    expected_qk = apply_rotary(qkv[:, : heads + kv_heads], cos, sin)
    expected_cache, cache = (KVCache(1, 8, 4, kv_heads, head_dim, dtype, torch.device("cpu")) for _ in range(2))
    slots = torch.randperm(32, generator=gen)[:tokens]
    v = qkv[:, heads + kv_heads :]
    expected_cache.write(0, slots, expected_qk[:, heads:], v)
    qk = qkv[:, : heads + kv_heads]
    kernels[1].rotary_kv_write(qk, v, cos, sin, cache.layer(0), slots, heads)
    _close(qk, expected_qk, dtype)
    assert torch.equal(cache.tensor, expected_cache.tensor)  # k as rotated here, v as given, nothing else


# ---- gated activations ------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-x) of a large x: inf, as on a GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,width", [(1, 40), (5, 1536)])
@pytest.mark.parametrize("gelu_tanh", [False, True])
def test_gated_activations(kernels, dtype, tokens, width, gelu_tanh):
    gen = torch.Generator().manual_seed(width + tokens)
    gate_up = _random((tokens, 2 * width), dtype, gen, 3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if gelu_tanh else F.silu(gate)
    _close(kernels[1].gated_activation(gate_up, gelu_tanh), act * up, dtype)


# ---- decode paged attention -------------------------------------------------------------------------
SHAPES = [(8, 2, 16), (9, 3, 64), (4, 4, 32)]  # (query heads, KV heads, head dim): GQA, a group of 3, none
CONTEXTS = [1, 15, 16, 17, 64, 65, 300]  # inside a block, on block and tile edges, past several tiles
BLOCK_SIZE, NUM_BLOCKS = 16, 128


def _decode_case(heads, kv_heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    kv = _random((2, kv_heads, NUM_BLOCKS, BLOCK_SIZE, head_dim), dtype, gen)
    lens = torch.tensor(CONTEXTS, dtype=torch.int32)
    width = -(-max(CONTEXTS) // BLOCK_SIZE)
    order = torch.randperm(NUM_BLOCKS, generator=gen)  # scattered blocks, in any order
    tables = torch.stack([order.roll(17 * i)[:width] for i in range(len(CONTEXTS))]).to(torch.int32)
    q = _random((len(CONTEXTS), heads, head_dim), dtype, gen)
    return q, kv, tables, lens


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_decode_attention_equals_the_torch_path(kernels, heads, kv_heads, head_dim, dtype):
    q, kv, tables, lens = _decode_case(heads, kv_heads, head_dim, dtype, seed=heads)
    scale = head_dim**-0.5
    got = kernels[0].paged_decode_attention(q, kv, tables, lens, scale)
    expected = decode_attention(q, kv, DecodeBatch(tables, lens, BLOCK_SIZE, None), scale)
    assert got.dtype == dtype
    # bfloat16: the kernel's softmax weights are rounded to bfloat16 before the product with V
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("window", [1, 16, 48, 100])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES[:2])
def test_decode_attention_reads_its_sliding_window_only(kernels, heads, kv_heads, head_dim, window):
    """Equal to the torch path's window, and the blocks before each window (NaN here, as a freed
    block's place) are never read."""
    q, kv, tables, lens = _decode_case(heads, kv_heads, head_dim, torch.float32, seed=window)
    scale = head_dim**-0.5
    expected = decode_attention(q, kv, DecodeBatch(tables, lens, BLOCK_SIZE, None), scale, window)
    keep = torch.zeros(NUM_BLOCKS, dtype=torch.bool)
    for row, n in enumerate(CONTEXTS):
        keep[tables[row, max(0, n - window) // BLOCK_SIZE : -(-n // BLOCK_SIZE)].long()] = True
    poisoned = kv.masked_fill(~keep.view(1, 1, -1, 1, 1), float("nan"))
    got = kernels[0].paged_decode_attention(q, poisoned, tables, lens, scale, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# ---- a whole model ----------------------------------------------------------------------------------
class _Counted:
    """A kernel module whose launchers count their calls (so a case can tell they ran)."""

    def __init__(self, module) -> None:
        self.module, self.calls = module, collections.Counter()

    def __getattr__(self, name: str):
        launcher = getattr(self.module, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return launcher(*args, **kwargs)

        return counted


def _on_triton(engine, attention, fused: _Counted) -> None:
    """The engine's layers take the Triton kernels, as on CUDA (gpu_kernels.py chooses them there)."""
    for module in engine.model.modules():
        for holder in (module, *vars(module).values()):
            if isinstance(getattr(holder, "_ops", None), _LazyOps):
                holder._ops._gpu = fused
    engine.runner.decode_kernel = attention.paged_decode_attention


def _greedy(engine, long_prompt, short_prompt, switch) -> dict[str, list[int]]:
    """The long prompt's prefill first, then `switch()`, then the short prompt's prefill beside
    the long one's decodes, and every step after: each request's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("long", None, long_prompt, params)
    outputs = {out.request_id: out for out in engine.step()}
    switch()
    engine.add_request("short", None, short_prompt, params)
    while engine.has_unfinished_requests():
        outputs.update((out.request_id, out) for out in engine.step())
    return {rid: list(out.outputs[0].token_ids) for rid, out in outputs.items()}


def test_a_model_on_the_triton_kernels_decodes_as_on_torch(kernels, family_dir):
    """Gemma 3 (unit-offset norms, q/k norms over each head, GeGLU, sliding and global layers):
    greedy tokens with every Triton kernel equal those of the torch path, for a prompt prefilled
    on them and one that decodes on them past its 32-token window. (Its long prefill runs on
    torch in both runs: the interpreter runs each program of a kernel in Python.)"""
    long_prompt, short_prompt = [(7 * i) % 500 + 3 for i in range(31)], [5, 9, 11]  # 31 + 3 > 32
    runs = []
    for triton in (False, True):
        llm = LLM(model=family_dir("gemma3"), dtype="float32", num_kv_blocks=64, attention_backend="torch")
        fused = _Counted(kernels[1])
        switch = (lambda: _on_triton(llm.engine, kernels[0], fused)) if triton else (lambda: None)
        runs.append(_greedy(llm.engine, long_prompt, short_prompt, switch))
    assert runs[1] == runs[0]
    assert {"rms_norm", "rotary_kv_write", "gated_activation"} <= set(fused.calls)
