"""Which model specs the engine can load, told without loading them (no torch).

The loader (`loader.load_model_source`) takes four forms; this module names them, so that a tool
that only writes configs (`disagg plan -o`) refuses at once a spec `disagg serve` would fail on
minutes later on a cluster. Checks here are what is knowable without reading weights: a GGUF
file's magic, a Hugging Face directory's `config.json` model type, a random shape's name.
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
GGUF_MAGIC = b"GGUF"


def loadable_forms() -> str:
    """The forms of spec the engine loads, as a message lists them."""
    shapes = ", ".join(f"{RANDOM_PREFIX}{name}" for name in named_shapes())
    return (
        f"{RANDOM_PREFIX}<shape> (random weights of a known shape: {shapes}); "
        "a .gguf file (a Llama or Qwen2 model); "
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
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return f"{path} has no readable config.json (not a Hugging Face model directory)"
    if model_type not in SUPPORTED_HF_MODEL_TYPES:
        return f"{path} holds a {model_type!r} model; the engine runs {', '.join(SUPPORTED_HF_MODEL_TYPES)}"
    return ""


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
