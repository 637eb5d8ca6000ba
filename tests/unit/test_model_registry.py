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


# ---- random: shapes of the new families, from their published config.json ----------------------------
# The fields of each model's config.json on the Hugging Face hub (Gemma 3: its text_config),
# in the flat form those files have (transformers 5 writes rope_parameters and layer_types instead).
PUBLISHED = {
    "qwen3-8b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000, rope_scaling=None, tie_word_embeddings=False, attention_bias=False,
        use_sliding_window=False, sliding_window=None, max_window_layers=36, hidden_act="silu",
        bos_token_id=151643, eos_token_id=151645,
    ),
    "mistral-7b-v0.1": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False, hidden_act="silu",
        bos_token_id=1, eos_token_id=2,
    ),
    "gemma3-12b": dict(
        model_type="gemma3_text", vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024, sliding_window_pattern=6,
        query_pre_attn_scalar=256, final_logit_softcapping=None, attn_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1,
    ),
}  # fmt: skip


@pytest.mark.parametrize("shape", sorted(PUBLISHED))
def test_a_random_shape_is_its_published_config_as_its_family_reads_it(shape):
    import dataclasses

    read = models.config_from_hf(PUBLISHED[shape], "x")
    assert dataclasses.replace(read, name="") == dataclasses.replace(named_shapes()[shape], name="")


def test_gemma3_12b_layers_five_local_to_one_global():
    groups = named_shapes()["gemma3-12b"].layer_groups
    assert [(g.window, g.layers) for g in groups] == [(None, (5, 11, 17, 23, 29, 35, 41, 47)),
                                                      (1024, tuple(i for i in range(48) if i % 6 != 5))]  # fmt: skip


@pytest.mark.parametrize("shape", sorted(named_shapes()))
def test_the_planner_counts_every_checkpoint_tensor(shape):
    """param_count (planner, torch-free) equals the elements of every tensor the family loads."""
    import math

    from disagg.planner.models import param_count

    config = named_shapes()[shape]
    assert param_count(config) == sum(math.prod(s) for _, s in models.expected_weight_shapes(config))


def test_published_sizes():
    from disagg.planner.models import param_count

    sizes = {name: round(param_count(named_shapes()[name]) / 1e9, 2) for name in PUBLISHED}
    assert sizes == {"qwen3-8b": 8.19, "mistral-7b-v0.1": 7.24, "gemma3-12b": 11.77}  # the text model's


@pytest.mark.parametrize("shape", sorted(named_shapes()))
def test_a_config_written_back_reads_the_same(shape):
    """to_hf_dict (a converted GGUF's config.json, benchmarks' model dirs) and the family's mapping agree."""
    import dataclasses

    config = named_shapes()[shape]
    assert dataclasses.replace(models.config_from_hf(config.to_hf_dict(), config.name), name="") == dataclasses.replace(
        config, name=""
    )
