"""What a model family declares (see the package docstring, disagg/engine/models/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from disagg.engine.model_config import ModelConfig

WeightShapes = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]  # the Hugging Face config.json `model_type` values it loads
    config_from_hf: Callable[[dict, str], ModelConfig]  # (config.json dict, model name) -> ModelConfig
    model_class: type  # a CausalLM subclass (models/causal_lm.py): the decoder layer it stacks
    weight_shapes: Callable[[ModelConfig], WeightShapes]  # checkpoint tensors by HF name, in load order
    # Other checkpoint layouts the family loads, tried first (e.g. experts fused into 3-D tensors).
    other_layouts: tuple[Callable[[ModelConfig], WeightShapes], ...] = ()
