"""Whether a model fits on a TP x PP group of devices, and how many KV tokens are left room for.

Weights split evenly over the TP ranks (heads, MLP columns, a mixture of experts' experts, every
one of them resident, and the vocabulary alike); PP stages hold
whole layers, the first stage the embeddings and the last the LM head (both when tied). The KV of
a token splits the same way, by heads over TP and by layers over PP. The most loaded device decides.
`utilization` (vLLM's gpu_memory_utilization) leaves the rest for activations and the runtime.

Pure Python: the planner runs on any laptop.
"""

from __future__ import annotations

import math

from disagg.engine.model_config import ModelConfig
from disagg.planner import models
from disagg.planner.hardware import Hardware

DEFAULT_UTILIZATION = 0.9


def shape_error(config: ModelConfig, tp: int, pp: int) -> str:
    """Why a TP x PP cannot run this model ("" when it can)."""
    if tp < 1 or pp < 1:
        return f"TP and PP must be >= 1, got TP {tp} PP {pp}"
    if config.num_attention_heads % tp or config.num_key_value_heads % tp:
        heads = f"{config.num_attention_heads} heads and {config.num_key_value_heads} KV heads"
        return f"TP {tp} must divide the {heads} of {config.name or 'the model'}"
    if pp > config.num_hidden_layers:
        return f"PP {pp} exceeds the {config.num_hidden_layers} layers of {config.name or 'the model'}"
    return ""


def check_shape(config: ModelConfig, tp: int, pp: int) -> None:
    error = shape_error(config, tp, pp)
    if error:
        raise ValueError(error)


def weight_bytes_per_device(config: ModelConfig, tp: int, pp: int, dtype_bytes: int = 2) -> float:
    """Bytes of weights on the most loaded device of a TP x PP group."""
    check_shape(config, tp, pp)
    layers = math.ceil(config.num_hidden_layers / pp) * models.layer_params(config)
    embeddings = models.embedding_params(config)
    head = 0 if config.tie_word_embeddings and pp == 1 else models.lm_head_params(config)
    ends = embeddings + head if pp == 1 else max(embeddings, head)
    return (layers + ends) * dtype_bytes / tp


def kv_bytes_per_token_per_device(config: ModelConfig, tp: int, pp: int, dtype_bytes: int = 2) -> float:
    layers = math.ceil(config.num_hidden_layers / pp)
    return 2 * layers * config.num_key_value_heads / tp * config.head_dim * dtype_bytes


def activation_bytes_per_device(config: ModelConfig, tokens: int, tp: int, dtype_bytes: int = 2) -> float:
    """The largest activations of one step of `tokens` tokens: the MLP's input and intermediate
    (twice: before and after the activation function) and a few hidden-sized buffers, split over
    TP. An engine that sizes its cache after a trial step of its token budget (vLLM) keeps this."""
    per_token = 2 * _mlp_width(config) + (4 + config.num_experts_per_tok) * config.hidden_size
    return tokens * per_token * dtype_bytes / tp


def _mlp_width(config: ModelConfig) -> int:
    """A token's widest MLP intermediate: a dense layer's, or its k experts' together."""
    dense = config.intermediate_size if config.num_moe_layers < config.num_hidden_layers else 0
    return max(dense, config.num_experts_per_tok * config.moe_intermediate_size)


def kv_capacity_tokens(
    config: ModelConfig,
    hardware: Hardware,
    tp: int,
    pp: int,
    utilization: float = DEFAULT_UTILIZATION,
    dtype_bytes: int = 2,
    activation_tokens: int = 0,
) -> int:
    """KV tokens one instance can hold once its weights are loaded (0 when the weights do not fit),
    with room kept for the activations of a step of `activation_tokens` tokens."""
    if not 0 < utilization <= 1:
        raise ValueError(f"memory utilization must be in (0, 1], got {utilization}")
    free = hardware.memory_bytes * utilization - weight_bytes_per_device(config, tp, pp, dtype_bytes)
    free -= activation_bytes_per_device(config, activation_tokens, tp, dtype_bytes)
    per_token = kv_bytes_per_token_per_device(config, tp, pp, dtype_bytes)
    return max(0, int(free // per_token))


def fits(
    config: ModelConfig,
    hardware: Hardware,
    tp: int,
    pp: int,
    kv_tokens: int = 0,
    utilization: float = DEFAULT_UTILIZATION,
    dtype_bytes: int = 2,
) -> bool:
    """The shape is valid, the weights fit, and there is room for `kv_tokens` of KV."""
    if shape_error(config, tp, pp):
        return False
    free = hardware.memory_bytes * utilization - weight_bytes_per_device(config, tp, pp, dtype_bytes)
    return free > 0 and kv_capacity_tokens(config, hardware, tp, pp, utilization, dtype_bytes) >= kv_tokens
