"""The models the planner knows by name, and the sizes a roofline needs from a model's shape.

Every named engine shape, the default model, and OPT-13B/66B/175B: DistServe profiled OPT on A100s,
so OPT is how we check the roofline against a real GPU system. Our engine cannot load OPT; its
ModelConfig here (architecture "opt") only describes sizes. OPT differs from the Llama family in
ways that change those sizes: a two-matrix MLP (fc1, fc2) instead of a gated three-matrix one,
biases on every linear layer, LayerNorm (weight and bias), learned positions (2 spare rows, as HF's
OPTLearnedPositionalEmbedding has) and an LM head tied to the embeddings.

Pure Python: the planner runs on any laptop.
"""

from __future__ import annotations

from disagg.config import DEFAULT_MODEL
from disagg.engine.model_config import ModelConfig
from disagg.engine.model_shapes import named_shapes

_OPT_POSITION_OFFSET = 2  # HF's OPT keeps two extra position rows


def _opt(name: str, hidden: int, layers: int, heads: int, ffn: int) -> ModelConfig:
    return ModelConfig(
        architecture="opt",
        vocab_size=50272,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,  # multi-head attention: every head has its own K and V
        head_dim=hidden // heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attention_bias=True,
        name=name,
    )


def known_models() -> dict[str, ModelConfig]:
    """Name -> shape; a fresh dict each call. OPT is listed under its Hugging Face name."""
    models = {name: _named(name, config) for name, config in named_shapes().items()}
    models[DEFAULT_MODEL] = _named(DEFAULT_MODEL, named_shapes()["smollm2-135m"])
    models["facebook/opt-13b"] = _opt("facebook/opt-13b", 5120, 40, 40, 20480)
    models["facebook/opt-66b"] = _opt("facebook/opt-66b", 9216, 64, 72, 36864)
    models["facebook/opt-175b"] = _opt("facebook/opt-175b", 12288, 96, 96, 49152)
    return models


def _named(name: str, config: ModelConfig) -> ModelConfig:
    return ModelConfig(**{**config.__dict__, "name": name})


def model_spec(name: str) -> ModelConfig:
    """A model's shape by name: a known name, `random:<shape>`, or an OPT name without `facebook/`."""
    models = known_models()
    key = name.strip().lower().removeprefix("random:")
    for candidate in (key, f"facebook/{key}"):
        if candidate in models:
            return models[candidate]
    raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(models))}")


# ---- sizes ----------------------------------------------------------------------------------------
def _is_opt(config: ModelConfig) -> bool:
    return config.architecture == "opt"


def layer_linear_params(config: ModelConfig) -> float:
    """Weights of one decoder layer's matrices (Q, K, V, O and the MLP, or all its experts and
    the router), without biases or norms: what memory holds (an average over the layers)."""
    return config.linear_params() / config.num_hidden_layers


def _layer_small_params(config: ModelConfig) -> int:
    """Biases and norms of one layer: negligible for time, counted for memory. Norms: each
    family's hidden-size ones (Gemma 3 has four) and, where it has them, q's and k's per-head norms."""
    h = config.hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    if _is_opt(config):  # every linear has a bias; two LayerNorms with weight and bias
        return q + 2 * kv + h + config.intermediate_size + h + 4 * h
    return config.layer_small_params


def embedding_params(config: ModelConfig) -> int:
    """Token (and, for OPT, position) embeddings plus the final norm."""
    h = config.hidden_size
    positions = (config.max_position_embeddings + _OPT_POSITION_OFFSET) * h if _is_opt(config) else 0
    final_norm = 2 * h if _is_opt(config) else h
    return config.vocab_size * h + positions + final_norm


def lm_head_params(config: ModelConfig) -> int:
    """The output projection; tied heads share the embedding's memory but still cost its FLOPs."""
    return config.vocab_size * config.hidden_size


def layer_params(config: ModelConfig) -> float:
    return layer_linear_params(config) + _layer_small_params(config)


def param_count(config: ModelConfig) -> int:
    """Every weight: what memory holds (a mixture of experts' experts all resident)."""
    tied = 0 if config.tie_word_embeddings else lm_head_params(config)
    layers = config.linear_params() + config.num_hidden_layers * _layer_small_params(config)
    return layers + embedding_params(config) + tied


def weight_bytes(config: ModelConfig, dtype_bytes: int = 2) -> int:
    return param_count(config) * dtype_bytes


def expert_bytes(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """One expert's weights in every MoE layer (0 for a dense model): what each expert a step's
    tokens touch adds to the weights it reads."""
    return config.expert_params * config.num_moe_layers * dtype_bytes


def dense_weight_bytes(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """The weights every step reads whatever its tokens: all but the experts."""
    return weight_bytes(config, dtype_bytes) - config.num_experts * expert_bytes(config, dtype_bytes)


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers."""
    return config.kv_bytes_per_token * dtype_bytes


def flops_per_token(config: ModelConfig) -> int:
    """Multiply-adds of the decoder layers' matrices, for one token (2 FLOPs per weight): of
    the active ones, its k experts of each MoE layer."""
    return 2 * config.linear_params(active=True)


def lm_head_flops(config: ModelConfig) -> int:
    """The LM head for one sequence: engines compute logits for the last position only."""
    return 2 * lm_head_params(config)


def attention_flops_per_pair(config: ModelConfig) -> int:
    """One query attending to one key, over all layers: Q.K and the weighted sum of V, 2 FLOPs each."""
    return 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
