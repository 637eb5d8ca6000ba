"""Which model specs the engine can load, told without loading them (no torch).

The loader (`loader.load_model_source`) takes four forms; this module names them, so that a tool
that only writes configs (`disagg plan -o`) refuses at once a spec `disagg serve` would fail on
minutes later on a cluster. Checks here are what is knowable without reading weights: a GGUF
file's magic, a Hugging Face directory's `config.json` model type and RoPE scaling, a random
shape's name. Some model types are refused on purpose, saying why (REFUSED_HF_MODEL_TYPES).
"""

from __future__ import annotations

import json
import os

from disagg.config import DEFAULT_MODEL
from disagg.engine.model_shapes import named_shapes

RANDOM_PREFIX = "random:"
# What the model families run (disagg.engine.models.supported_model_types(), kept equal by a unit test;
# this list is torch-free, for the tools that check a spec without loading it).
SUPPORTED_HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "mixtral")
_MLA = (
    "multi-latent attention (DeepSeek-V2/V3's compressed KV: a latent vector and a decoupled RoPE key "
    "per token instead of per-head K and V) is not implemented: neither the paged cache's layout nor "
    "the KV transfer knows it"
)
_MULTIMODAL = (
    "a multimodal model (a vision or audio tower beside the language model); the engine runs text-only decoders"
)
REFUSED_HF_MODEL_TYPES = {
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "kimi_k2"), _MLA),
    **dict.fromkeys(
        (
            "gemma3",  # Gemma3ForConditionalGeneration (its text-only checkpoints are gemma3_text)
            "gemma3n",
            "paligemma",
            "llava",
            "llava_next",
            "llava_onevision",
            "mllama",
            "llama4",
            "mistral3",
            "pixtral",
            "qwen2_vl",
            "qwen2_5_vl",
            "qwen2_audio",
            "qwen2_5_omni",
            "qwen3_vl",
            "qwen3_vl_moe",
            "qwen3_omni_moe",
            "internvl",
            "idefics3",
            "smolvlm",
        ),
        _MULTIMODAL,
    ),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # model_config.ROPE_TYPES (a unit test keeps them equal)
GGUF_MAGIC = b"GGUF"


def loadable_forms() -> str:
    """The forms of spec the engine loads, as a message lists them."""
    shapes = ", ".join(f"{RANDOM_PREFIX}{name}" for name in named_shapes())
    return (
        f"{RANDOM_PREFIX}<shape> (random weights of a known shape: {shapes}); "
        "a .gguf file (a Llama, Mistral, Qwen2, Qwen3 or Gemma 3 model); "
        f"a Hugging Face directory of a {'/'.join(SUPPORTED_HF_MODEL_TYPES)}-architecture model; "
        f"or {DEFAULT_MODEL} (the default model)"
    )


def model_spec_error(spec: str) -> str:
    """Why the engine cannot load `spec` ("" when it can, as far as its files tell)."""
    if not isinstance(spec, str) or not spec.strip():
        return "the model must be a non-empty string"
    if spec == DEFAULT_MODEL:
        return ""
    if spec.startswith(RANDOM_PREFIX):
        shape = spec[len(RANDOM_PREFIX) :]
        return "" if shape in named_shapes() else f"{shape!r} is not a known random shape"
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return _hf_dir_error(path)
    if os.path.isfile(path):
        return _gguf_error(path)
    return _not_a_path_error(spec)


def _hf_dir_error(path: str) -> str:
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = dict(json.load(f))
    except (OSError, ValueError, TypeError):
        return f"{path} has no readable config.json (not a Hugging Face model directory)"
    error = hf_config_error(config)
    return f"{path}: {error}" if error else ""


def hf_config_error(config: dict) -> str:
    """Why the engine cannot run what a config.json describes ("" when, as far as this tells, it can)."""
    return model_type_error(config.get("model_type")) or rope_type_error(config)


def model_type_error(model_type) -> str:
    """Why the engine does not run a config.json's `model_type` ("" when it does)."""
    if model_type in SUPPORTED_HF_MODEL_TYPES:
        return ""
    why = REFUSED_HF_MODEL_TYPES.get(model_type, "the engine has no family for it")
    return f"model_type {model_type!r} is not supported: {why} (supported: {', '.join(SUPPORTED_HF_MODEL_TYPES)})"


def rope_type_error(config: dict) -> str:
    """Why the engine cannot rotate as a config.json asks ("" when it can): its rope_scaling or
    rope_parameters (transformers 5 nests these by layer type)."""
    for params in _rope_settings(config):
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            return f"RoPE scaling {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    return ""


def _rope_settings(config: dict) -> list[dict]:
    settings = [config.get("rope_scaling") or {}, config.get("rope_parameters") or {}]
    nested = [value for value in settings[1].values() if isinstance(value, dict)]
    return [s for s in settings + nested if isinstance(s, dict)]


def _gguf_error(path: str) -> str:
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        return f"{path} is unreadable ({exc.strerror})"
    return "" if magic == GGUF_MAGIC else f"{path} is not a GGUF file"


def _not_a_path_error(spec: str) -> str:
    """A name that is no file: a hint when it is a shape the engine knows under `random:`."""
    shape = spec.strip().lower()
    if shape in named_shapes():
        return f"{spec!r} is a shape, not weights (random weights of it: {RANDOM_PREFIX}{shape})"
    return f"{spec!r} is no file or directory here, nor a random shape or the default model"
