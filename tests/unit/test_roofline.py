"""The planner's model and hardware catalogues, memory check and roofline profile (pure, fast)."""

from __future__ import annotations

import statistics

import pytest

from support import distserve_data

from disagg.placement.profile import Profile, load_profile
from disagg.planner import memory, models
from disagg.planner.hardware import hardware_spec
from disagg.planner.roofline import (
    HELD_OUT_DECODE,
    HELD_OUT_PREFILL,
    Efficiency,
    calibrate,
    compare,
    roofline_profile,
    step_errors,
)

# The figures reported for the calibration (roofline vs DistServe's A100 profile, held-out grid).
OPT13B_MEDIAN, OPT13B_MAX = 0.10, 0.25
OPT66B_MEDIAN = 0.12  # all of OPT-66B's shapes together, with factors fitted on OPT-13B only


def step(model: str, hardware: str, tp: int = 1, pp: int = 1):
    return roofline_profile(model, hardware, [(tp, pp)]).step_model(tp, pp)


def distserve(model: str) -> Profile:
    path = distserve_data("profiler-a100-80g.distserve.json")
    return load_profile(str(path), model, served=False)  # the forward pass, as the roofline models it


# ---- models and hardware -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, billions",
    [("facebook/opt-13b", 12.85), ("opt-66b", 65.7), ("opt-175b", 174.6), ("llama3-8b", 8.03), ("qwen2-7b", 7.62)],
)
def test_parameter_counts_match_the_published_sizes(name, billions):
    assert models.param_count(models.model_spec(name)) / 1e9 == pytest.approx(billions, rel=0.01)


def test_default_model_is_smollm2_shape():
    default = models.model_spec("smollm2-135m-instruct")
    assert default.hidden_size == 576 and default.num_hidden_layers == 30
    assert models.param_count(default) == pytest.approx(134.5e6, rel=0.01)


def test_unknown_names_raise_value_error_listing_known_ones():
    with pytest.raises(ValueError, match="opt-13b"):
        models.model_spec("gpt-5")
    with pytest.raises(ValueError, match="a100-80gb"):
        hardware_spec("tpu-v9")


def test_a_measured_cpu_variant_is_the_cpu_under_its_own_name():
    from disagg.planner.hardware import threads_per_rank

    variant = hardware_spec("cpu-2t")
    assert variant.name == "cpu-2t" and variant.peak_flops == hardware_spec("cpu").peak_flops
    assert threads_per_rank("cpu-2t") == 2 and threads_per_rank("a100-80gb") is None
    for bad in ("cpu-0t", "cpu-t", "tpu-2t"):
        with pytest.raises(ValueError, match="unknown hardware"):
            hardware_spec(bad)


def test_kv_transfer_uses_the_node_link_and_across_nodes_is_slower():
    a100 = hardware_spec("a100-80gb")
    profile = roofline_profile("opt-13b", a100)
    assert profile.kv_transfer.bandwidth_bytes_per_s == a100.intra_node_bandwidth
    assert a100.kv_transfer(inter_node=True).transfer_ms(1e9) > profile.kv_transfer.transfer_ms(1e9)


# ---- the roofline --------------------------------------------------------------------------------
def test_13b_decode_on_a100_is_about_weights_over_bandwidth():
    config, a100 = models.model_spec("opt-13b"), hardware_spec("a100-80gb")
    weights_ms = models.weight_bytes(config) / a100.memory_bandwidth * 1e3
    decode = step("opt-13b", "a100-80gb").decode_ms(1, 512)
    assert 10 < decode < 25
    assert weights_ms < decode < 2 * weights_ms


def test_tp2_is_faster_than_tp1_but_not_twice():
    tp1, tp2 = step("opt-13b", "a100-80gb", 1), step("opt-13b", "a100-80gb", 2)
    for one, two in (
        (tp1.decode_ms(8, 8 * 512), tp2.decode_ms(8, 8 * 512)),
        (tp1.prefill_ms([1024]), tp2.prefill_ms([1024])),
    ):
        assert one / 2 < two < one


def test_newer_gpus_are_faster_and_h200_decodes_faster_than_h100():
    a100, h100, h200 = (step("llama3-8b", hw) for hw in ("a100-80gb", "h100-sxm", "h200"))
    assert h100.prefill_ms([2048]) < a100.prefill_ms([2048])
    assert h100.decode_ms(16, 16 * 1024) < a100.decode_ms(16, 16 * 1024)
    # Same FLOP/s, more bandwidth: decode gains, long prefills barely do.
    assert h200.decode_ms(16, 16 * 1024) < 0.9 * h100.decode_ms(16, 16 * 1024)
    assert h200.prefill_ms([4096]) == pytest.approx(h100.prefill_ms([4096]), rel=0.05)


def test_prefill_grows_with_tokens_superlinearly():
    prefill = step("opt-13b", "a100-80gb")
    times = [prefill.prefill_ms([n]) for n in (512, 1024, 2048, 4096)]
    increments = [b - a for a, b in zip(times, times[1:])]
    assert all(b > 2 * a for a, b in zip(increments, increments[1:]))  # each doubling costs more than twice


def test_pipeline_stages_add_a_handoff_not_a_speedup():
    profile = roofline_profile("opt-66b", "a100-80gb", [(4, 1), (4, 2)])
    pp1, pp2 = profile.step_model(4, 1).prefill_ms([512]), profile.step_model(4, 2).prefill_ms([512])
    assert profile.pp_handoff_ms > 0
    assert pp1 < pp2 < 1.05 * pp1


def test_a_shape_the_model_cannot_run_is_refused():
    with pytest.raises(ValueError, match="divide"):
        roofline_profile("opt-13b", "a100-80gb", [(3, 1)])
    with pytest.raises(ValueError, match="layers"):
        roofline_profile("tiny", "cpu", [(1, 3)])


def test_roofline_profile_round_trips_through_its_file(tmp_path):
    profile = roofline_profile("llama2-7b", "h100-sxm", [(1, 1), (2, 1)])
    profile.save(str(tmp_path / "p.json"))
    loaded = load_profile(str(tmp_path / "p.json"))
    assert loaded.source == "roofline" and loaded.entries == profile.entries
    assert loaded.kv_bytes_per_token == 524288


# ---- calibration against DistServe's A100 profiles --------------------------------------------------
def test_calibration_reproduces_the_defaults():
    # Attention's factor is loosely pinned by the profile (0.39-0.43 fit as well), so compare what
    # the factors predict, not the factors themselves.
    measured = distserve("facebook/opt-13b")
    fitted = calibrate("opt-13b", "a100-80gb", measured)
    ours = roofline_profile("opt-13b", "a100-80gb", measured.shapes)
    refit = roofline_profile("opt-13b", "a100-80gb", measured.shapes, efficiency=fitted)
    for shape in measured.shapes:
        assert max(abs(e) for e in step_errors(ours.step_model(*shape), refit.step_model(*shape))) < 0.02
    assert fitted.compute == pytest.approx(Efficiency().compute, rel=0.05)
    assert fitted.memory == pytest.approx(Efficiency().memory, rel=0.05)


def test_calibrated_roofline_matches_distserve_opt13b_on_a_held_out_grid():
    measured = distserve("facebook/opt-13b")
    roofline = roofline_profile("opt-13b", "a100-80gb", measured.shapes)
    report = compare(roofline, measured, prefill=HELD_OUT_PREFILL, decode=HELD_OUT_DECODE)
    assert sorted(report) == [(1, 1), (2, 1), (4, 1)]
    for shape, errors in report.items():
        assert errors["median"] < OPT13B_MEDIAN and errors["max"] < OPT13B_MAX, shape


def test_opt66b_with_factors_fitted_on_opt13b():
    measured = distserve("facebook/opt-66b")
    roofline = roofline_profile("opt-66b", "a100-80gb", measured.shapes)
    report = compare(roofline, measured, prefill=HELD_OUT_PREFILL, decode=HELD_OUT_DECODE)
    assert len(report) == 4
    assert statistics.median(e["median"] for e in report.values()) < OPT66B_MEDIAN


# ---- memory ----------------------------------------------------------------------------------------
def test_opt175b_needs_eight_a100s():
    config, a100 = models.model_spec("opt-175b"), hardware_spec("a100-80gb")
    assert not memory.fits(config, a100, 1, 1)
    assert not memory.fits(config, a100, 4, 1)
    assert memory.fits(config, a100, 8, 1, kv_tokens=20_000)
    assert memory.fits(config, a100, 4, 2, kv_tokens=20_000)


def test_kv_capacity_is_what_is_left_after_the_weights():
    config, a100 = models.model_spec("opt-13b"), hardware_spec("a100-80gb")
    free = 0.9 * a100.memory_bytes - memory.weight_bytes_per_device(config, 1, 1)
    assert memory.kv_capacity_tokens(config, a100, 1, 1) == int(free // models.kv_bytes_per_token(config))
    assert memory.kv_capacity_tokens(config, a100, 2, 1) > 2 * memory.kv_capacity_tokens(config, a100, 1, 1)
    assert not memory.fits(config, a100, 1, 1, kv_tokens=10**6)


def test_tp_must_divide_heads_and_kv_heads_and_pp_must_not_exceed_layers():
    llama3 = models.model_spec("llama3-8b")  # 32 heads, 8 KV heads
    assert memory.shape_error(llama3, 8, 1) == ""
    assert "divide" in memory.shape_error(llama3, 16, 1)
    assert "layers" in memory.shape_error(llama3, 1, 33)
    assert not memory.fits(llama3, hardware_spec("h100-sxm"), 16, 1)
