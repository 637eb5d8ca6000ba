"""Whether a model fits on a TP x PP group of devices, and how many KV tokens are left room for.

Weights split evenly over the TP ranks (heads, MLP columns, a mixture of experts' experts, every
one of them resident, and the vocabulary alike); PP stages hold
whole layers, the first stage the embeddings and the last the LM head (both when tied). The KV of
a token splits the same way, by heads over TP and by layers over PP. The most loaded device decides.
`utilization` (vLLM's gpu_memory_utilization) leaves the rest for activations and the runtime.
Under a sliding window every layer shares, a request holds only its window's KV (kv_tokens_held).

Pure Python: the planner runs on any laptop.
"""

from __future__ import annotations

import math

from disagg.config import EngineConfig, ParallelConfig, ServingConfig
from disagg.engine.memory_fit import DTYPE_BYTES, activation_bytes, dtype_name, fit_error, kv_block_bytes, memory_need
from disagg.engine.block_manager import max_blocks_held
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


def kv_tokens_held(config: ModelConfig, context_tokens: int, block_size: int = 16) -> int:
    """The KV slots (whole blocks) a decoding request of `context_tokens` holds: every block of
    its context, or, where every layer has the same sliding window W, those its window spans (at
    most W + block_size: the engine releases the blocks behind it). A model with layers of
    several windows holds every block (the engine keeps one block table for all layers)."""
    return max_blocks_held(context_tokens, block_size, config.shared_window, 1) * block_size


def activation_bytes_per_device(config: ModelConfig, tokens: int, tp: int, dtype_bytes: int = 2) -> float:
    """The largest activations of one step of `tokens` tokens: the MLP's input and intermediate
    (twice: before and after the activation function) and a few hidden-sized buffers, split over
    TP. An engine that sizes its cache after a trial step of its token budget (vLLM) keeps this."""
    return activation_bytes(config, tokens, tp, dtype_bytes)


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


def worker_kv_tokens(
    config: ModelConfig,
    hardware: Hardware,
    tp: int,
    pp: int,
    max_num_batched_tokens: int,
    utilization: float = DEFAULT_UTILIZATION,
) -> int:
    """The KV tokens a worker of our engine may ask for on this hardware and still start: the rule
    config_fit_errors checks (its weights as the engine places them, the vocabulary whole on every
    TP rank, and a step's activations), on every pipeline stage."""
    device_type = _device_type(hardware)
    engine = EngineConfig(
        parallel=ParallelConfig(tp, pp), max_num_batched_tokens=max_num_batched_tokens, dtype="auto", weights="auto"
    )
    available = hardware.memory_bytes * utilization
    room = min(memory_need(config, engine, device_type, pp_rank=r).max_kv_bytes(available) for r in range(pp))
    dtype_bytes = DTYPE_BYTES[dtype_name(engine.dtype, device_type, engine.weights)]
    return room // kv_block_bytes(config, engine, dtype_bytes) * engine.block_size


def _device_type(hardware: Hardware) -> str:
    return "cpu" if hardware.name.startswith("cpu") else "cuda"


def config_fit_errors(
    config: ServingConfig, model: ModelConfig, hardware: dict[str, Hardware], utilization: float = DEFAULT_UTILIZATION
) -> list[str]:
    """Why workers of a serving config would be refused at start on this hardware (`hardware`:
    each pool role's), by the engine's own rule (disagg.engine.memory_fit), one line each; [] when
    all fit. A worker may use its share of a device (gpu_memory_utilization, or the fraction of a
    GPU its pool asks for), less `1 - utilization` of it for the runtime (CUDA context, graphs,
    allocator slack), which the engine's check at start finds already taken."""
    errors = []
    for role, pool in config.pools():
        for index in range(pool.num_instances):
            engine = config.pool_engine_config(pool, index)
            for pp_rank in range(pool.pipeline_parallel_size):
                error = _worker_fit_error(model, engine, hardware[role], utilization, pp_rank)
                errors += [f"{role} instance {index} (stage {pp_rank}): {error}"] if error else []
    return errors


def _worker_fit_error(
    model: ModelConfig, engine: EngineConfig, spec: Hardware, utilization: float, pp_rank: int
) -> str:
    device_type = _device_type(spec)
    share = (engine.gpu_memory_utilization or 1.0) if device_type == "cuda" else 1.0
    available = spec.memory_bytes * share * utilization
    need = memory_need(model, engine, device_type, pp_rank=pp_rank)
    return fit_error(need, available, f"one {spec.name} device at {share:g} x {utilization:g} of its memory")
