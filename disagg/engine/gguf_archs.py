"""What each GGUF architecture (`general.architecture`) is in the engine's terms: the Hugging Face
model_type it becomes, its tensors' names, what llama.cpp's converter did to the tensors, and the
metadata its family reads beyond the shape every architecture shares (gguf_convert reads that).

Windows: `{arch}.attention.sliding_window` (tokens) and `{arch}.attention.sliding_window_pattern`
(an int n: every n-th layer global, the others windowed; or one bool per layer, true = windowed),
as llama.cpp reads them. Without a pattern every layer is windowed, except Gemma 3's, where
llama.cpp takes every 6th layer global. A `llama` file with a window is a Mistral (llama.cpp's
converter writes Mistral as `llama`; a file without the key, as its converter writes Mistral-7B-v0.1,
loads as Llama with full attention, as llama.cpp runs it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from disagg.engine.model_config import FULL_ATTENTION, SLIDING_ATTENTION

Meta = Callable[..., object]  # meta(key) or meta(key, default): a metadata value

_LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# A mixture of experts as llama.cpp's converter writes it: the router, and each layer's experts in
# one 3-D tensor per matrix ([experts, out, in]), which the MoE families load as they are
# (disagg/engine/models/moe_lm.py, "GGUF's layout"). Per-expert tensors (ffn_gate.<e>, older
# Mixtral files) are not read.
_MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_GEMMA3_LAYER_NAMES = {
    **_LLAMA_LAYER_NAMES,
    **_QK_NORM_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",  # Gemma's MLP has a norm on each side
    "post_ffw_norm": "post_feedforward_layernorm",
}
GEMMA3_LOCAL_ROPE_THETA = 10_000.0  # llama.cpp takes it as fixed: the file does not carry it
GEMMA3_27B_LAYERS = 62


@dataclass(frozen=True)
class GGUFArch:
    model_type: str
    layer_names: dict[str, str]  # GGUF blk.N.<name> -> model.layers.N.<name>
    permuted_qk: bool = False  # llama.cpp's LlamaModel permutes Q/K rows for its rotary layout
    norm_offset: float = 0.0  # llama.cpp's Gemma converters store each norm weight plus this
    default_pattern: int = 0  # sliding_window_pattern when the file has none (0: every layer windowed)
    fields: Callable[[str, Meta, dict], dict] = field(default=lambda arch, meta, shape: {})


def _qwen3_fields(arch: str, meta: Meta, shape: dict) -> dict:
    return {"qk_norm": True}


def _llama_fields(arch: str, meta: Meta, shape: dict) -> dict:
    """A `llama` file with experts is a Mixtral (llama.cpp writes it so): experts as wide as
    feed_forward_length, the top k renormalised."""
    experts = int(meta(f"{arch}.expert_count", 0) or 0)
    if not experts:
        return {}
    return {
        "architecture": "mixtral",
        "num_experts": experts,
        "num_experts_per_tok": int(meta(f"{arch}.expert_used_count")),
        "moe_intermediate_size": shape["intermediate_size"],
        "norm_topk_prob": True,
    }


def _qwen3moe_fields(arch: str, meta: Meta, shape: dict) -> dict:
    """Qwen3-MoE: every layer sparse (llama.cpp's rule; the file has no mlp_only_layers), the top k
    renormalised unless the file says otherwise (llama.cpp renormalises Qwen3-MoE's)."""
    return {
        "qk_norm": True,
        "num_experts": int(meta(f"{arch}.expert_count")),
        "num_experts_per_tok": int(meta(f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(meta(f"{arch}.expert_feed_forward_length")),
        "norm_topk_prob": bool(meta(f"{arch}.expert_weights_norm", True)),
    }


def _gemma3_fields(arch: str, meta: Meta, shape: dict) -> dict:
    """What Gemma 3 reads beyond the shape, with llama.cpp's rules for what the file lacks: the
    score scale is head_dim^-1/2, except for the 27B (62 layers): (hidden / heads)^-1/2."""
    is_27b = shape["num_hidden_layers"] == GEMMA3_27B_LAYERS
    softcap = meta(f"{arch}.final_logit_softcapping", None)
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "qk_norm": True,
        "norms_per_layer": 4,
        "query_pre_attn_scalar": shape["hidden_size"] // shape["num_attention_heads"] if is_27b else shape["head_dim"],
        "rope_local_theta": GEMMA3_LOCAL_ROPE_THETA,
        "final_logit_softcapping": float(softcap) if softcap is not None else None,
    }


ARCHS = {
    "llama": GGUFArch("llama", {**_LLAMA_LAYER_NAMES, **_MOE_LAYER_NAMES}, permuted_qk=True, fields=_llama_fields),
    "qwen2": GGUFArch("qwen2", _LLAMA_LAYER_NAMES),
    "qwen3": GGUFArch("qwen3", {**_LLAMA_LAYER_NAMES, **_QK_NORM_NAMES}, fields=_qwen3_fields),
    "gemma3": GGUFArch("gemma3_text", _GEMMA3_LAYER_NAMES, norm_offset=1.0, default_pattern=6, fields=_gemma3_fields),
    "qwen3moe": GGUFArch(
        "qwen3_moe", {**_LLAMA_LAYER_NAMES, **_QK_NORM_NAMES, **_MOE_LAYER_NAMES}, fields=_qwen3moe_fields
    ),
}


def window_fields(arch: str, meta: Meta, num_layers: int) -> dict:
    """sliding_window, layer_types (and, for a windowed `llama`, the model_type mistral)."""
    window = meta(f"{arch}.attention.sliding_window", None)
    if not window:
        return {}
    pattern = meta(f"{arch}.attention.sliding_window_pattern", ARCHS[arch].default_pattern)
    if isinstance(pattern, list):
        windowed = [bool(p) for p in pattern]
    else:
        windowed = [not pattern or (i + 1) % int(pattern) != 0 for i in range(num_layers)]
    fields = {
        "sliding_window": int(window),
        "layer_types": tuple(SLIDING_ATTENTION if w else FULL_ATTENTION for w in windowed),
    }
    if arch == "llama":  # Mistral's family (or Mixtral's, with experts): a window on every layer
        if not all(windowed):
            raise ValueError(
                "a llama file with both windowed and global layers is not supported (Mistral's window is on every layer)"
            )
        if not meta(f"{arch}.expert_count", 0):
            fields["architecture"] = "mistral"
    return fields
