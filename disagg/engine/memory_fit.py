"""Whether one worker's weights, KV cache and activations fit the memory it may use.

One rule, checked in two places: by the engine at start, against what its device has free,
before it allocates anything (engine.py); and by the planner against a hardware spec, before
anything starts (disagg.planner.memory). A worker that does not fit is refused with the figures
and what to change, instead of failing halfway through its allocations (or, on a host, being
killed by the kernel once its KV cache's pages are touched).

The weights are counted as the model places them on this rank (engine/models/llama.py): the
layers of its pipeline stage split over tensor parallelism, the vocabulary projections whole.
Quantized weights count at their packed size, a lower bound: the rule never refuses what fits.

Pure arithmetic: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.config import EngineConfig, GiB
from disagg.engine.model_config import ModelConfig
from disagg.engine.partition import layer_range

QUANTIZED_BYTES_PER_PARAM = {"int8": 1.0, "int4": 0.5, "fp8": 1.0}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_name(dtype: str, device_type: str, weights: str = "auto") -> str:
    """The engine's dtype: `dtype`, or (auto) what `weights` names, else bfloat16 on a GPU and
    float32 on a CPU."""
    if dtype == "auto" and weights in ("fp32", "bf16"):
        return "float32" if weights == "fp32" else "bfloat16"
    if dtype == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    return dtype


def kv_element_bytes(engine: EngineConfig) -> int:
    """One KV cache element's bytes as configured (the device taken as named, `auto` as a CPU):
    for a frontend whose workers' model card does not say (disagg.engine.model_card)."""
    device_type = "cuda" if engine.device.startswith("cuda") else "cpu"
    return DTYPE_BYTES[dtype_name(engine.dtype, device_type, engine.weights)]


def weight_bytes_per_param(weights: str, dtype_bytes: int, device_type: str, from_gguf: bool) -> float:
    """What a weight takes once loaded: its dtype's size, or a quantized format's (under auto, a
    GGUF's blocks stay quantized on a CPU; 4-bit, the smallest, is counted)."""
    if weights in QUANTIZED_BYTES_PER_PARAM:
        return QUANTIZED_BYTES_PER_PARAM[weights]
    if weights == "auto" and device_type == "cpu" and from_gguf:
        return QUANTIZED_BYTES_PER_PARAM["int4"]
    return dtype_bytes


def rank_weight_params(model: ModelConfig, tp: int, pp: int, pp_rank: int = 0) -> int:
    """Weights one rank holds: its stage's layers over TP; the embedding on the first stage, the
    final norm and LM head on the last (a tied head shares the embedding where both are there).
    TP splits a layer's norms too here: a rank holds them whole, a few KiB more than counted."""
    start, end = layer_range(model.num_hidden_layers, pp_rank, pp)
    first, last = pp_rank == 0, pp_rank == pp - 1
    layer = model.layer_linear_params + model.layer_small_params
    embedding = model.vocab_size * model.hidden_size
    head = 0 if model.tie_word_embeddings else embedding
    copies = int(first) + int(last and not first and model.tie_word_embeddings)  # a later stage's tied head
    ends = embedding * copies + (head + model.hidden_size) * last
    return int(layer * (end - start)) // tp + ends


def kv_block_bytes(model: ModelConfig, engine: EngineConfig, dtype_bytes: int) -> int:
    """One KV block of one rank: K and V of its heads, for the layers of the largest stage (every
    rank sizes its cache for that one, so that all ranks have the same number of blocks)."""
    p = engine.parallel
    layers = -(-model.num_hidden_layers // p.pipeline_parallel_size)
    heads = model.num_key_value_heads // p.tensor_parallel_size
    return 2 * layers * engine.block_size * heads * model.head_dim * dtype_bytes


def kv_num_blocks(model: ModelConfig, engine: EngineConfig, dtype_bytes: int) -> int:
    """The blocks the engine allocates: `num_kv_blocks`, else `kv_cache_memory_bytes`' worth."""
    return engine.num_kv_blocks or max(1, engine.kv_cache_memory_bytes // kv_block_bytes(model, engine, dtype_bytes))


def activation_bytes(model: ModelConfig, tokens: int, tp: int, dtype_bytes: int) -> int:
    """The largest activations of one step of `tokens` tokens: the MLP's input and intermediate
    (twice: before and after the activation function) and a few hidden-sized buffers, split over
    TP. An engine that sizes its cache after a trial step of its token budget (vLLM) keeps this."""
    per_token = 2 * _mlp_width(model) + (4 + model.num_experts_per_tok) * model.hidden_size
    return tokens * per_token * dtype_bytes // tp


def _mlp_width(model: ModelConfig) -> int:
    """A token's widest MLP intermediate: a dense layer's, or its k experts' together."""
    dense = model.intermediate_size if model.num_moe_layers < model.num_hidden_layers else 0
    return max(dense, model.num_experts_per_tok * model.moe_intermediate_size)


@dataclass(frozen=True)
class MemoryNeed:
    """What one worker needs of its device's memory, in bytes."""

    weight_bytes: int
    kv_bytes: int
    activation_bytes: int  # one step of the token budget (an estimate)
    kv_block_bytes: int

    @property
    def total(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes

    def max_kv_bytes(self, available: float) -> int:
        """The largest KV cache that fits `available` bytes beside the rest (0: none does)."""
        room = int(available) - self.weight_bytes - self.activation_bytes
        return max(0, room // self.kv_block_bytes * self.kv_block_bytes)


def memory_need(
    model: ModelConfig, engine: EngineConfig, device_type: str, *, from_gguf: bool = False, pp_rank: int = 0
) -> MemoryNeed:
    """What rank `pp_rank` (its largest TP share) of an instance with these engine settings needs
    on a device of this type ("cuda" or "cpu")."""
    dtype_bytes = DTYPE_BYTES[dtype_name(engine.dtype, device_type, engine.weights)]
    p = engine.parallel
    per_param = weight_bytes_per_param(engine.weights, dtype_bytes, device_type, from_gguf)
    weights = int(rank_weight_params(model, p.tensor_parallel_size, p.pipeline_parallel_size, pp_rank) * per_param)
    block = kv_block_bytes(model, engine, dtype_bytes)
    kv = kv_num_blocks(model, engine, dtype_bytes) * block
    activations = activation_bytes(model, engine.max_num_batched_tokens, p.tensor_parallel_size, dtype_bytes)
    return MemoryNeed(weights, kv, activations, block)


def fit_error(need: MemoryNeed, available: float, where: str) -> str:
    """Why the worker does not fit `available` bytes of `where` ("" when it does), with the
    figures and what to change."""
    if need.total <= available:
        return ""
    kv_room = need.max_kv_bytes(available)
    change = (
        f"set kv_cache_memory_bytes to at most {kv_room} ({_gib(kv_room)}; or num_kv_blocks to at most "
        f"{kv_room // need.kv_block_bytes})"
        if kv_room
        else "the weights alone do not fit: use more tensor/pipeline parallelism, a smaller dtype or "
        "quantized weights, or a device with more memory"
    )
    return (
        f"the worker needs {_gib(need.total)}: {_gib(need.weight_bytes)} of weights + {_gib(need.kv_bytes)} of KV "
        f"cache + {_gib(need.activation_bytes)} of activations, but {where} has {_gib(available)} for it; {change}"
    )


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.2f} GiB"
