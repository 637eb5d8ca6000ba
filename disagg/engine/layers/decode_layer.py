"""A Llama-family decoder layer of a decode-only CPU step as one C++ call (csrc/decoder_layer.cpp).

At batch 1 a layer's work is ~10 kernels of a few microseconds each, and from Python each one
costs as much again in module calls, views and torch.ops dispatch. The op makes the same kernel
calls in the same order from C++, so its rows get the op-by-op path's bits (and so the same bits
in any batch). It applies where every part of the layer is one it computes: weights on our 4/8-bit
kernels without bias, one tensor-parallel rank, no norm over q and k heads, SiLU, float32 norms;
and to steps whose every row decodes a generated token (EngineConfig.fused_layer switches it off).
"""

from __future__ import annotations

import torch

from disagg.engine.kv_cache import KVCache
from disagg.engine.layers.attention import AttentionMetadata
from disagg.engine.layers.cpu_kernels import cpu_ops
from disagg.engine.layers.fused import FusedRMSNorm
from disagg.engine.layers.quantized import Int4Weight, Int8Weight


class FusedDecodeLayer:
    """The op for one layer, with the layer's weights and shape gathered once."""

    def __init__(self, ops, attention, mlp, input_norm: FusedRMSNorm, post_norm: FusedRMSNorm):
        """`attention`, `mlp`: the layer's LlamaAttention and LlamaMLP (checked by `fused_decode_layer`)."""
        self._op = ops.decode_layer
        self._weights = (
            input_norm.scale(),
            post_norm.scale(),
            input_norm.eps,
            *_kernel_args(attention.qkv_proj.packed),
            *_kernel_args(attention.o_proj.packed),
            *_kernel_args(mlp.gate_up_proj.packed),
            *_kernel_args(mlp.down_proj.packed),
        )
        self._shape = (attention.num_heads, attention.num_kv_heads, attention.scale, attention.window or 0)
        self._cache_index = attention.cache_index

    def __call__(self, x, residual, cos, sin, kv_cache: KVCache, meta: AttentionMetadata):
        """As the layer's forward: (h, residual)."""
        decode = meta.decode
        return self._op(
            x,
            residual,
            *self._weights,
            cos,
            sin,
            kv_cache.layer(self._cache_index),
            meta.slot_mapping,
            decode.block_tables,
            decode.context_lens,
            *self._shape,
        )


def runs_fused(x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this step's rows may take the op: all of them decodes of generated tokens (whose
    GEMMs take the quantized kernels), attention on the C++ decode kernel, float32."""
    decode = meta.decode
    return (
        decode is not None
        and decode.kernel is not None
        and not meta.prefills
        and meta.decode_rows == x.shape[0]
        and x.dtype == torch.float32
    )


def fused_decode_layer(attention, mlp, input_norm, post_norm, backend: str) -> FusedDecodeLayer | None:
    """The op for a layer of these parts, or None where a part is not one it computes
    (`backend`: EngineConfig.attention_backend)."""
    device = input_norm.weight.device
    ops = cpu_ops(device, backend)
    if ops is None or not hasattr(ops, "decode_layer"):
        return None
    if not (_computes_attention(attention) and _computes_mlp(mlp) and _is_fp32_norm(input_norm, post_norm)):
        return None
    return FusedDecodeLayer(ops, attention, mlp, input_norm, post_norm)


def _computes_attention(attention) -> bool:
    projections = (attention.qkv_proj, attention.o_proj)
    return attention.q_norm is None and all(_on_our_kernel(p) and p.tp.size == 1 for p in projections)


def _computes_mlp(mlp) -> bool:
    projections = (mlp.gate_up_proj, mlp.down_proj)
    return not mlp.act.gelu_tanh and all(_on_our_kernel(p) and p.tp.size == 1 for p in projections)


def _on_our_kernel(linear) -> bool:
    weight = linear.packed
    return linear.bias is None and isinstance(weight, (Int4Weight, Int8Weight)) and weight.kernels is not None


def _is_fp32_norm(*norms) -> bool:
    return all(isinstance(n, FusedRMSNorm) and n.weight.dtype == torch.float32 for n in norms)


def _kernel_args(weight: Int4Weight | Int8Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scales) as the op takes them: q4 blocks with no scales, or int8 with theirs."""
    if isinstance(weight, Int4Weight):
        return weight.blocks, torch.empty(0)  # its blocks carry their own scales
    return weight.q, weight.scales
