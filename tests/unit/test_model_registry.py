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


# ---- refused at `disagg plan` (model_spec_error) and at `disagg serve` (the loader, before any worker) -----
def _hf_dir(tmp_path, **config) -> str:
    import json

    directory = tmp_path / str(config.get("model_type"))
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.mark.parametrize(
    "config,reason",
    [
        (dict(model_type="deepseek_v3"), "multi-latent attention"),
        (dict(model_type="deepseek_v2"), "multi-latent attention"),
        (dict(model_type="gemma3", text_config={"model_type": "gemma3_text"}), "multimodal"),
        (dict(model_type="qwen2_5_vl"), "multimodal"),
        (dict(model_type="llava"), "multimodal"),
        (dict(model_type="opt"), "no family for it"),
        (dict(model_type="qwen2", rope_scaling={"type": "longrope", "factor": 4.0}), "RoPE scaling 'longrope'"),
        (dict(model_type="gemma3_text", rope_parameters={"full_attention": {"rope_type": "dynamic"}}), "'dynamic'"),
    ],
)
def test_what_the_engine_cannot_run_is_refused_saying_why(tmp_path, config, reason):
    from disagg.engine.loader import load_model_source
    from disagg.engine.model_specs import model_spec_error

    directory = _hf_dir(tmp_path, **config)
    assert reason in model_spec_error(directory)  # `disagg plan`
    with pytest.raises(ModelLoadError, match=reason):  # `disagg serve` loads the source before any worker
        load_model_source(directory, cache_dir=str(tmp_path / "cache"))


def test_a_yarn_qwen2_is_accepted_at_plan_time(tmp_path):
    from disagg.engine.model_specs import model_spec_error

    yarn = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
    assert model_spec_error(_hf_dir(tmp_path, model_type="qwen2", rope_scaling=yarn)) == ""


def test_the_torch_free_rope_types_are_the_models():
    from disagg.engine.model_config import ROPE_TYPES
    from disagg.engine.model_specs import SUPPORTED_ROPE_TYPES

    assert SUPPORTED_ROPE_TYPES == ROPE_TYPES
