"""Model families: one module per family, and the registry that picks one for a config.

A family is a module here that ends with a `FAMILY = ModelFamily(...)` (models/family.py):

- `name`, and `model_types`: the Hugging Face config.json `model_type` values it loads;
- `config_from_hf(d, name) -> ModelConfig`: how its config.json maps onto ModelConfig's fields
  (usually `ModelConfig.from_hf_dict(d, name)` plus the fields the family adds);
- `model_class`: the torch module it builds, a `CausalLM` subclass (models/causal_lm.py: the
  embedding, the stage's stack of layers, the final norm and the vocabulary projection, weight
  loading and quantization, all shared). The subclass names the decoder layer it stacks in
  `make_layer(cfg, layer_index, cache_index, tp, backends)`; that layer takes
  (h, residual, cos, sin, kv_cache, meta) and returns (h, residual), and builds its attention and
  MLP from the shared layers (layers/, and the Llama family's LlamaAttention and LlamaMLP);
- `weight_shapes(config)`: every tensor a checkpoint of that config holds, by Hugging Face name, in
  load order (models/weights.py builds a dense decoder's); `other_layouts`, other sets of names
  the family also loads (a checkpoint in one of them is read by its names). Checkpoint names map onto the module
  tree by name: `model.layers.3.mlp.down_proj.weight` loads into `layers.3.mlp.down_proj`, and
  CausalLM._SHARDS lists the linears loaded as shards of one fused linear of ours.

To add a family: write its module, add its FAMILY to `FAMILIES` below, and its model types to
model_specs.SUPPORTED_HF_MODEL_TYPES (the torch-free list `disagg plan` and `disagg serve` check
before anything loads; a unit test keeps the two equal). A GGUF architecture it reads goes in
gguf_archs.ARCHS (tensor names, metadata).

What a family's layers may read from ModelConfig, shared: the sliding window of each layer
(`attention_window(layer)`, None = global; `layer_groups`: layers by window, what a block manager
frees per group), `qk_norm`, `hidden_act`, `query_pre_attn_scalar`, `rope_local_theta`,
`final_logit_softcapping`. A built model tells its stage's windows by local layer index
(`CausalLM.local_attention_windows`, the KV cache's layer slots). Attention with a window reads
no block before the window's first position (layers/attention.py).
"""

from __future__ import annotations

from collections.abc import Collection

from disagg.engine.model_config import ModelConfig
from disagg.engine.models import gemma3, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe
from disagg.engine.models.causal_lm import Backends, CausalLM
from disagg.engine.models.family import ModelFamily, WeightShapes
from disagg.engine.layers.parallel import SINGLE, TPGroup
from disagg.errors import ModelLoadError

FAMILIES: tuple[ModelFamily, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    gemma3.FAMILY,
    qwen3_moe.FAMILY,
    mixtral.FAMILY,
)


def family_of(model_type: str) -> ModelFamily:
    """The family that loads a Hugging Face `model_type` (ModelConfig.architecture)."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ModelLoadError(
        f"model_type {model_type!r} is not supported (supported: {', '.join(supported_model_types())})"
    )


def supported_model_types() -> tuple[str, ...]:
    return tuple(t for family in FAMILIES for t in family.model_types)


def config_from_hf(d: dict, name: str = "") -> ModelConfig:
    """A config.json dict, mapped by the family of its `model_type`."""
    return family_of(d.get("model_type")).config_from_hf(d, name)


def expected_weight_shapes(config: ModelConfig) -> WeightShapes:
    """Every tensor a checkpoint of this config holds, by Hugging Face name, in load order."""
    return family_of(config.architecture).weight_shapes(config)


def checkpoint_weight_shapes(config: ModelConfig, names: Collection[str]) -> WeightShapes:
    """The tensors of the layout a checkpoint holding `names` is written in: the family's
    own (`weight_shapes`), or another it also loads (`other_layouts`) when that one's tensors
    are all there (e.g. transformers 5's experts fused into 3-D tensors)."""
    family = family_of(config.architecture)
    for layout in family.other_layouts:
        shapes = layout(config)
        if all(name in names for name, _ in shapes):
            return shapes
    return family.weight_shapes(config)


def build_model(
    config: ModelConfig,
    max_model_len: int,
    tp: TPGroup = SINGLE,
    pp_rank: int = 0,
    pp_size: int = 1,
    backends: Backends = Backends(),
    expert_parallel: bool = False,
) -> CausalLM:
    """This stage's (and TP rank's) model for `config`, weights not loaded yet."""
    model_class = family_of(config.architecture).model_class
    return model_class(
        config,
        max_model_len,
        tp=tp,
        pp_rank=pp_rank,
        pp_size=pp_size,
        backends=backends,
        expert_parallel=expert_parallel,
    )
