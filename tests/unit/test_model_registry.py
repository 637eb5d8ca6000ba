"""The model family registry (disagg.engine.models): lookups, and the torch-free list kept equal to it."""

from __future__ import annotations

import pytest

from disagg.engine import models
from disagg.engine.model_shapes import named_shapes
from disagg.engine.model_specs import SUPPORTED_HF_MODEL_TYPES
from disagg.engine.models.causal_lm import CausalLM
from disagg.errors import ModelLoadError


def test_the_torch_free_list_names_exactly_the_registered_model_types():
    assert sorted(SUPPORTED_HF_MODEL_TYPES) == sorted(models.supported_model_types())


def test_each_model_type_belongs_to_one_family():
    types = models.supported_model_types()
    assert len(types) == len(set(types))


def test_every_family_builds_a_causal_lm():
    assert all(issubclass(family.model_class, CausalLM) for family in models.FAMILIES)


def test_an_unknown_model_type_is_refused_naming_the_supported_ones():
    with pytest.raises(ModelLoadError, match="'opt' is not supported.*llama"):
        models.family_of("opt")


@pytest.mark.parametrize("shape", sorted(named_shapes()))
def test_every_random_shape_has_a_family_and_weights(shape):
    config = named_shapes()[shape]
    weights = models.expected_weight_shapes(config)
    assert weights[0][0] == "model.embed_tokens.weight"
    assert len({name for name, _ in weights}) == len(weights), "no tensor listed twice"
