"""Llama family (Llama 2/3.x, SmolLM2): the decoder layer most
families build on (pre-norm attention and a gated MLP, fused QKV and gate/up projections).

LlamaAttention also takes what later families add to it, each read from ModelConfig: a sliding
window per layer, a norm over each head of q and k (`qk_norm`), another score scale
(`query_pre_attn_scalar`); LlamaMLP takes the gate's activation (`hidden_act`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from disagg.engine.kv_cache import KVCache
from disagg.engine.layers.attention import AttentionMetadata, paged_attention
from disagg.engine.layers.decode_layer import FusedDecodeLayer, fused_decode_layer, runs_fused
from disagg.engine.layers.fused import GatedActivation, Rotary
from disagg.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from disagg.engine.layers.parallel import TPGroup
from disagg.engine.model_config import ModelConfig
from disagg.engine.models.causal_lm import Backends, CausalLM
from disagg.engine.models.family import ModelFamily
from disagg.engine.models.weights import decoder_weight_shapes

_UNRESOLVED = object()


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_index: int,
        cache_index: int,
        tp: TPGroup,
        backends: Backends,
        qk_norm: Callable[[int], nn.Module] | None = None,
    ):
        """`qk_norm(head_dim)`: builds the norms over each head of q and of k (cfg.qk_norm)."""
        super().__init__()
        self.cache_index = cache_index  # this layer's slot in the stage-local KV cache
        self.window = cfg.attention_window(layer_index)  # None: global attention
        self.num_heads = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard(cfg.num_key_value_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.scale = cfg.attention_scale
        d = cfg.head_dim
        self.q_norm = qk_norm(d) if cfg.qk_norm else None
        self.k_norm = qk_norm(d) if cfg.qk_norm else None
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            {"q": cfg.num_attention_heads * d, "k": cfg.num_key_value_heads * d, "v": cfg.num_key_value_heads * d},
            bias=cfg.attention_bias,
            tp=tp,
            gemm=backends.gemm,
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, tp=tp, gemm=backends.gemm)
        self.rope = Rotary(backends.attention)

    def forward(self, x, cos, sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        q_size = heads * self.head_dim
        qkv = self.qkv_proj(x, meta.decode_rows).view(n, heads + 2 * kv_heads, self.head_dim)
        v = qkv[:, heads + kv_heads :]
        # q's and k's heads are adjacent: one rotary call for both (a decode step makes 2 per layer
        # fewer), which on CUDA writes k and v to the cache too.
        q, k = self.rope.rotate_and_store(
            self._normed_qk(qkv), v, cos, sin, kv_cache, self.cache_index, meta.slot_mapping
        )
        out = paged_attention(q, k, v, kv_cache.layer(self.cache_index), meta, self.scale, self.window)
        return self.o_proj(out.view(n, q_size), meta.decode_rows)

    def _normed_qk(self, qkv: torch.Tensor) -> torch.Tensor:
        """q's and k's heads [T, heads + kv_heads, D], each head normalized where the family says so."""
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.q_norm is None:
            return qkv[:, : heads + kv_heads]
        q, k = self.q_norm(qkv[:, :heads])[0], self.k_norm(qkv[:, heads : heads + kv_heads])[0]
        return torch.cat((q, k), dim=1)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, backends: Backends):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, {"gate": cfg.intermediate_size, "up": cfg.intermediate_size}, tp=tp, gemm=backends.gemm
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp=tp, gemm=backends.gemm)
        # GeGLU where the family says gelu_pytorch_tanh, else SwiGLU (ModelConfig.HIDDEN_ACTS)
        self.act = GatedActivation(backends.attention, gelu_tanh=cfg.hidden_act == "gelu_pytorch_tanh")

    def forward(self, x: torch.Tensor, decode_rows: int | None = None) -> torch.Tensor:
        """`decode_rows`: the step's (AttentionMetadata.decode_rows)."""
        if not self.act.gelu_tanh and self.gate_up_proj.fuses_silu_mul:  # a quantized weight's own kernel
            return self.down_proj(self.gate_up_proj.silu_mul(x, decode_rows), decode_rows)
        return self.down_proj(self.act(self.gate_up_proj(x, decode_rows)), decode_rows)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, model: CausalLM, cfg: ModelConfig, layer_index: int, cache_index: int, tp: TPGroup, backends: Backends
    ):
        super().__init__()
        qk_norm = functools.partial(model.make_norm, cfg, backends)
        self.self_attn = LlamaAttention(cfg, layer_index, cache_index, tp, backends, qk_norm)
        self.mlp = LlamaMLP(cfg, tp, backends)
        self.input_layernorm = model.make_norm(cfg, backends)
        self.post_attention_layernorm = model.make_norm(cfg, backends)
        self.backends = backends
        # The layer as one C++ call for decode-only steps (layers/decode_layer.py): resolved at
        # the first such step, once the weights are loaded and quantized; None where it does not apply.
        self._fused: FusedDecodeLayer | None | object = _UNRESOLVED if backends.fused_layer else None

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        if self._fused is not None and runs_fused(x, meta):
            fused = self._resolved_fused()
            if fused is not None:
                return fused(x, residual, cos, sin, kv_cache, meta)
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, meta.decode_rows), residual

    def _resolved_fused(self) -> FusedDecodeLayer | None:
        if self._fused is _UNRESOLVED:
            self._fused = fused_decode_layer(
                self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm, self.backends.attention
            )
        return self._fused


class LlamaForCausalLM(CausalLM):
    def make_layer(self, cfg, layer_index, cache_index, tp, backends):
        return LlamaDecoderLayer(self, cfg, layer_index, cache_index, tp, backends)


def config_from_hf(d: dict, name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(d, name=name)


FAMILY = ModelFamily(
    name="llama",
    model_types=("llama",),
    config_from_hf=config_from_hf,
    model_class=LlamaForCausalLM,
    weight_shapes=decoder_weight_shapes,
)
