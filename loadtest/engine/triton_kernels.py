"""Each Triton kernel of the CUDA path against the torch code it replaces, on a GPU, at
Llama-3-8B's shapes for a decode batch (issue 51): the largest difference (bf16) and the time of
a call each way. Under the interpreter on CPU the same kernels are tested for equality by
tests/unit/test_triton_kernels.py; here is what they gain on the device.

    python -m loadtest.engine.triton_kernels --out loadtest/out/triton_kernels.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from disagg.bench.results import host_line, write_results
from disagg.engine.kv_cache import KVCache
from disagg.engine.layers.attention import DecodeBatch, decode_attention
from disagg.engine.layers.norm import RMSNorm
from disagg.engine.layers.rotary import RotaryEmbedding, apply_rotary

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128  # Llama-3-8B
BLOCK_SIZE = 16


def timed_us(fn, device: torch.device, repeats: int = 5, calls: int = 20) -> float:
    """Median over `repeats` of the mean time of `calls` calls of fn(), in microseconds."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        times.append((time.perf_counter() - started) * 1e6 / calls)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def row(name: str, got: torch.Tensor, expected: torch.Tensor, triton_fn, torch_fn) -> dict:
    triton_us, torch_us = timed_us(triton_fn, got.device), timed_us(torch_fn, got.device)
    return {
        "kernel": name,
        "max_abs_diff": (got.float() - expected.float()).abs().max().item(),
        "max_abs": expected.float().abs().max().item(),
        "triton_us": round(triton_us, 1),
        "torch_us": round(torch_us, 1),
        "speedup": round(torch_us / triton_us, 2),
    }


def rms_norm_row(fused, x, residual) -> dict:
    norm = RMSNorm(HIDDEN, 1e-5).to(x.device, x.dtype)
    with torch.no_grad():
        norm.weight.normal_()
    got, _ = fused.rms_norm(x, residual, norm.weight, norm.eps)
    expected, _ = norm(x, residual)
    return row(
        "rms_norm+residual",
        got,
        expected,
        lambda: fused.rms_norm(x, residual, norm.weight, norm.eps),
        lambda: norm(x, residual),
    )


def rotary_row(fused, batch: int, device: torch.device) -> dict:
    qkv = torch.randn(batch, HEADS + 2 * KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    cos, sin = (
        RotaryEmbedding(HEAD_DIM, 8192, 500000.0)
        .to(device)
        .cos_sin(torch.randint(0, 8000, (batch,), device=device), torch.bfloat16)
    )
    caches = [KVCache(1, 256, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16, device) for _ in range(2)]
    slots = torch.randperm(256 * BLOCK_SIZE, device=device)[:batch]
    v = qkv[:, HEADS + KV_HEADS :]
    expected = apply_rotary(qkv[:, : HEADS + KV_HEADS], cos, sin)
    caches[1].write(0, slots, expected[:, HEADS:], v)
    qk = qkv[:, : HEADS + KV_HEADS].clone()
    fused.rotary_kv_write(qk, v, cos, sin, caches[0].layer(0), slots, HEADS)
    diff = max(
        (qk.float() - expected.float()).abs().max().item(), (caches[0].tensor - caches[1].tensor).abs().max().item()
    )

    def with_torch():
        rotated = apply_rotary(qkv[:, : HEADS + KV_HEADS], cos, sin)
        caches[1].write(0, slots, rotated[:, HEADS:], v)

    scratch = qkv[:, : HEADS + KV_HEADS].clone()  # rotated again and again: its values do not matter here
    figures = row(
        "rotary+kv_write",
        qk,
        expected,
        lambda: fused.rotary_kv_write(scratch, v, cos, sin, caches[0].layer(0), slots, HEADS),
        with_torch,
    )
    return {**figures, "max_abs_diff": diff}


def gated_row(fused, batch: int, device: torch.device) -> dict:
    gate_up = torch.randn(batch, 2 * INTERMEDIATE, device=device, dtype=torch.bfloat16)

    def with_torch():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    return row(
        "silu_mul", fused.gated_activation(gate_up), with_torch(), lambda: fused.gated_activation(gate_up), with_torch
    )


def attention_row(attention, batch: int, context: int, device: torch.device) -> dict:
    blocks = batch * (-(-context // BLOCK_SIZE))
    kv = torch.randn(2, KV_HEADS, blocks, BLOCK_SIZE, HEAD_DIM, device=device, dtype=torch.bfloat16)
    tables = torch.randperm(blocks, device=device).view(batch, -1).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    scale = HEAD_DIM**-0.5
    torch_batch = DecodeBatch(tables, lens, BLOCK_SIZE, None)
    got = attention.paged_decode_attention(q, kv, tables, lens, scale)
    expected = decode_attention(q, kv, torch_batch, scale)
    return row(
        f"decode_attention ctx {context}",
        got,
        expected,
        lambda: attention.paged_decode_attention(q, kv, tables, lens, scale),
        lambda: decode_attention(q, kv, torch_batch, scale),
    )


def run(batch: int, context: int, device: torch.device) -> dict:
    from disagg.engine.layers import triton_attention, triton_fused  # needs Triton

    torch.manual_seed(0)
    x = torch.randn(batch, HIDDEN, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    rows = [
        rms_norm_row(triton_fused, x, residual),
        rotary_row(triton_fused, batch, device),
        gated_row(triton_fused, batch, device),
        attention_row(triton_attention, batch, context, device),
    ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton's interpreter)"
    return {"device": name, "batch": batch, "context": context, "kernels": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64, help="decode rows")
    p.add_argument("--context", type=int, default=1024, help="tokens each decode attends to")
    p.add_argument(
        "--device", default="cuda", help="cpu: a smoke run, under TRITON_INTERPRET=1 (no timing worth reading)"
    )
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu needs TRITON_INTERPRET=1 in the environment (Triton reads it on import)")
    print(host_line(), flush=True)
    result = run(args.batch, args.context, torch.device(args.device))
    for r in result["kernels"]:
        print(
            f"{r['kernel']:>24}: triton {r['triton_us']:7.1f} us  torch {r['torch_us']:7.1f} us  x{r['speedup']:.2f}  "
            f"max |diff| {r['max_abs_diff']:.3g} (of {r['max_abs']:.3g})"
        )
    if args.out:
        write_results(args.out, result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
