"""The tensors a dense decoder's checkpoint holds, by Hugging Face name (what a family's
`weight_shapes` returns): the loader checks a checkpoint against them, and random weights
are drawn from them."""

from __future__ import annotations

from disagg.engine.model_config import ModelConfig
from disagg.engine.models.family import WeightShapes

LLAMA_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


def decoder_weight_shapes(config: ModelConfig, layer_norms: tuple[str, ...] = LLAMA_LAYER_NORMS) -> WeightShapes:
    """Every tensor, in load order: the embedding, each layer, the final norm, the LM head (untied).
    `layer_norms`: a layer's hidden-size norms, the first before attention; config.qk_norm: a
    norm over each head of q and of k."""
    shapes = [("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))]
    for i in range(config.num_hidden_layers):
        shapes += _layer_shapes(config, f"model.layers.{i}.", layer_norms, config.qk_norm)
    shapes.append(("model.norm.weight", (config.hidden_size,)))
    if not config.tie_word_embeddings:
        shapes.append(("lm_head.weight", (config.vocab_size, config.hidden_size)))
    return shapes


def _layer_shapes(config: ModelConfig, p: str, layer_norms: tuple[str, ...], qk_norm: bool) -> WeightShapes:
    h, q_out = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_out, inter = config.num_key_value_heads * config.head_dim, config.intermediate_size
    shapes = [(p + layer_norms[0] + ".weight", (h,)), (p + "self_attn.q_proj.weight", (q_out, h))]
    shapes += [(p + "self_attn.k_proj.weight", (kv_out, h)), (p + "self_attn.v_proj.weight", (kv_out, h))]
    if config.attention_bias:
        shapes += [
            (p + "self_attn.q_proj.bias", (q_out,)),
            (p + "self_attn.k_proj.bias", (kv_out,)),
            (p + "self_attn.v_proj.bias", (kv_out,)),
        ]
    if qk_norm:
        shapes += [
            (p + "self_attn.q_norm.weight", (config.head_dim,)),
            (p + "self_attn.k_norm.weight", (config.head_dim,)),
        ]
    shapes.append((p + "self_attn.o_proj.weight", (h, q_out)))
    shapes += [(p + norm + ".weight", (h,)) for norm in layer_norms[1:]]
    shapes += [
        (p + "mlp.gate_proj.weight", (inter, h)),
        (p + "mlp.up_proj.weight", (inter, h)),
        (p + "mlp.down_proj.weight", (h, inter)),
    ]
    return shapes
