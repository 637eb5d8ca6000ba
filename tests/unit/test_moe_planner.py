"""The planner's view of a mixture of experts: total against active parameters (ModelConfig), all
experts resident (memory), a decode step reading the active experts at batch 1 and more as the
batch grows (roofline and the latency model's expert term), the online fit keeping that term."""

from __future__ import annotations

import dataclasses

import pytest

from disagg.engine.model_shapes import named_shapes
from disagg.placement.latency_model import Coefficients, ExpertReads, StepModel, expected_experts_touched
from disagg.placement.online_fit import OnlineStepModel
from disagg.planner import memory, models
from disagg.planner.hardware import hardware_spec
from disagg.planner.roofline import Efficiency, roofline_profile
from disagg.step_work import Chunk, MeasuredStep, StepWork


@pytest.mark.parametrize(
    "shape,total,active", [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("mixtral-8x7b", 46.7e9, 12.9e9)]
)  # as their model cards state them
def test_total_and_active_parameters_are_the_published_ones(shape, total, active):
    config = named_shapes()[shape]
    assert config.total_params == pytest.approx(total, rel=0.01)
    assert config.active_params == pytest.approx(active, rel=0.02)
    assert models.param_count(config) == pytest.approx(total, rel=0.01)
    embeddings = 2 * config.vocab_size * config.hidden_size
    assert models.flops_per_token(config) == pytest.approx(2 * (config.active_params - embeddings), rel=0.001)


def test_dense_layers_count_as_dense():
    mini, dense = named_shapes()["qwen3-moe-mini"], named_shapes()["qwen3-moe-mini-dense"]
    assert dense.num_moe_layers == 0 and mini.num_moe_layers == 12
    # A token's 8 experts are as wide as the dense MLP: the same active weights, but the routers.
    assert mini.active_params - dense.active_params == 12 * 64 * 1024
    half = dataclasses.replace(mini, mlp_only_layers=tuple(range(0, 12, 2)))
    assert half.num_moe_layers == 6 and [half.is_moe_layer(i) for i in (0, 1)] == [False, True]
    assert dataclasses.replace(mini, decoder_sparse_step=3).num_moe_layers == 4  # layers 2, 5, 8, 11


def test_memory_holds_every_expert():
    mixtral = named_shapes()["mixtral-8x7b"]
    a100 = hardware_spec("a100-80gb")
    # 93 GB of bfloat16 weights: not on one 80 GB device, on two.
    assert memory.weight_bytes_per_device(mixtral, 1, 1) == pytest.approx(2 * 46.7e9, rel=0.01)
    assert not memory.fits(mixtral, a100, 1, 1) and memory.fits(mixtral, a100, 2, 1)


def test_experts_touched():
    assert expected_experts_touched(128, 8, 1) == pytest.approx(8)
    assert expected_experts_touched(128, 8, 0) == 0
    assert 8 < expected_experts_touched(128, 8, 8) < 64 < expected_experts_touched(128, 8, 32) < 128
    assert expected_experts_touched(128, 8, 10_000) == pytest.approx(128)


def test_roofline_decode_reads_active_experts_then_all():
    """Qwen3-30B-A3B on an H100: batch 1 reads the dense part and 8 experts a layer (far less
    than all 30B weights), a large batch all 128."""
    config = named_shapes()["qwen3-30b-a3b"]
    hw = hardware_spec("h100-sxm")
    step = roofline_profile(config, hw).step_model(1, 1)
    assert step.experts == ExpertReads(step.experts.ms_per_expert, 128, 8)
    read_all = models.weight_bytes(config) / hw.memory_bandwidth * 1e3
    one = step.decode_ms(1, 100) - Efficiency().overhead_ms
    assert one < 0.25 * read_all
    assert step.decode_ms(64, 6400) - step.decode_ms(1, 100) > 0.5 * read_all  # most experts read by then
    assert step.expert_ms(1) == pytest.approx(8 * step.experts.ms_per_expert)
    # A prefill of 2,000 tokens touches every expert.
    assert step.prefill_ms([2000]) - step.prefill(2000, 2000**2) == pytest.approx(128 * step.experts.ms_per_expert)


def test_step_model_expert_term_round_trips_and_scales():
    step = StepModel(
        Coefficients(1, 0.1, 0),
        Coefficients(2, 0.01, 0.5),
        Coefficients(2, 0.01, 0.5),
        50,
        experts=ExpertReads(0.3, 64, 8),
    )
    again = StepModel.from_dict(step.to_dict())
    assert again == step
    assert step.scaled(2).expert_ms(5) == pytest.approx(2 * step.expert_ms(5))
    # Several steps of one batch: each reads that batch's experts.
    assert step.decode_steps_ms(4, 40, 3) == pytest.approx(sum(step.decode_ms(4, 40 + 4 * j) for j in range(3)))
    assert step.decode_steps_within(4, 40, step.decode_steps_ms(4, 40, 3) + 1e-9) == 3
    mixed = StepWork((Chunk(0, 20),), 2, 300)
    assert step.step_ms(mixed) == pytest.approx(step.linear_step_ms(mixed) + step.expert_ms(22))


def test_online_fit_learns_the_linear_terms_around_the_expert_reads():
    """Steps timed exactly as a model with expert reads: the refit keeps the expert term and
    recovers the linear coefficients, rather than folding the reads into them."""
    truth = StepModel(
        Coefficients(5, 0.2, 0), Coefficients(3, 0.01, 0.4), Coefficients(3, 0.01, 0.4), experts=ExpertReads(0.5, 64, 8)
    )
    seed = dataclasses.replace(truth, prefill=Coefficients(1, 1, 0), decode_small=Coefficients(1, 1, 1))
    online = OnlineStepModel(seed, refit_every=4)
    for i in range(1, 40):
        batch = 1 + i % 7
        for work in (StepWork((), batch, 50 * i * batch), StepWork((Chunk(0, 10 * i),))):
            online.observe(MeasuredStep(work, truth.step_ms(work), i))
    fitted = online.model
    assert fitted.experts == truth.experts
    assert fitted.decode_small.c == pytest.approx(0.4, rel=0.05) and fitted.prefill.b == pytest.approx(0.2, rel=0.05)
