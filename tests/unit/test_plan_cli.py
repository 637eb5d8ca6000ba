"""`disagg plan`'s written config (mixed hardware, the model it serves) and its reference comparison."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import pytest
import yaml

from disagg.config import DEFAULT_MODEL, POOL_LABEL_SLIVER, ServingConfig
from disagg.engine.model_specs import model_spec_error
from disagg.placement.latency_model import Coefficients, StepModel
from disagg.placement.profile import Profile
from disagg.planner.hardware import hardware_spec
from disagg.planner.models import model_spec
from disagg.planner_cli.plan_cli import check_serve_model, cluster_kinds, comparison
from disagg.planner.plan_config import hardware_label_comment, serving_config_dict
from disagg.planner.reference import ReferencePool, parse_reference, reference_candidate
from disagg.planner.search import Candidate, NodeKind, PoolPlan, Search
from disagg.planner.workload import SimRequest
from disagg.slo import SLO

SLO_MS = SLO(ttft_ms=200.0, tpot_ms=100.0)


def two_kind_cluster(tmp_path) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(
        "nodes:\n  - {hardware: a100-80gb, count: 1, devices: 8}\n  - {hardware: l40s, count: 2, devices: 8}\n"
    )
    return str(path)


def disaggregated(prefill_hardware: str, decode_hardware: str) -> Candidate:
    pools = {
        "prefill": PoolPlan(2, 1, 1, prefill_hardware, "prefill_first", 16384, 1000),
        "decode": PoolPlan(1, 1, 2, decode_hardware, "chunked", 2048, 2000),
    }
    return Candidate("disaggregated", pools, 3.0, "distserve-alg1")


def written(tmp_path, candidate, kinds, serve_model=None) -> tuple[str, ServingConfig]:
    path = tmp_path / "plan.yaml"
    plan = serving_config_dict(candidate, "llama3-8b", SLO_MS, kinds, serve_model)
    text = hardware_label_comment(candidate, kinds) + yaml.safe_dump(plan, sort_keys=False)
    path.write_text(text)
    return text, ServingConfig.from_yaml(str(path))


# ---- mixed hardware ------------------------------------------------------------------------------
def test_a_two_kind_plan_pins_each_pool_to_its_hardware(tmp_path):
    kinds = cluster_kinds(two_kind_cluster(tmp_path), "llama3-8b", None, None)
    assert [(k.hardware.name, k.num_nodes) for k in kinds] == [("a100-80gb", 1), ("l40s", 2)]
    text, config = written(tmp_path, disaggregated("a100-80gb", "l40s"), kinds, "random:llama3-8b")
    assert config.prefill.resources == {"a100-80gb": POOL_LABEL_SLIVER}
    assert config.decode.resources == {"l40s": POOL_LABEL_SLIVER}
    assert config.prefill.num_gpus_per_worker == config.decode.num_gpus_per_worker == 1
    assert config.ray_address == "auto", "a Ray we start has no hardware labels"
    assert "--resources='{\"a100-80gb\": 1}'" in text and "--resources='{\"l40s\": 1}'" in text
    on_cluster = config.on_cluster()  # `disagg serve --cluster`: the pool's label beside the hardware's
    assert on_cluster.decode.resources == {"decode": POOL_LABEL_SLIVER, "l40s": POOL_LABEL_SLIVER}


def test_a_one_kind_plan_is_unchanged(tmp_path):
    kinds = [NodeKind(hardware_spec("a100-80gb"), None, 2, 8)]
    text, config = written(tmp_path, disaggregated("a100-80gb", "a100-80gb"), kinds, "random:llama3-8b")
    assert text.startswith("mode: disaggregated"), "no label comment"
    assert config.prefill.resources == {} and config.decode.resources == {}
    assert config.ray_address is None
    plan = serving_config_dict(disaggregated("a100-80gb", "a100-80gb"), "llama3-8b", SLO_MS, kinds)
    assert list(plan) == ["mode", "engine", "prefill", "decode", "slo"]
    assert list(plan["prefill"]) == [
        "num_instances",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "num_cpus_per_worker",
        "num_gpus_per_worker",
        "engine",
    ]


def test_cpu_pools_measured_at_different_threads_keep_their_own():
    kinds = [NodeKind(hardware_spec("cpu-1t"), None, 1, 2), NodeKind(hardware_spec("cpu-2t"), None, 1, 1)]
    plan = serving_config_dict(disaggregated("cpu-2t", "cpu-1t"), "llama3-8b", SLO_MS, kinds)
    assert "threads_per_worker" not in plan
    assert plan["decode"]["instances"] == [{"threads_per_worker": 1}, {"threads_per_worker": 1}]
    ServingConfig.from_dict(plan)
    same = serving_config_dict(disaggregated("cpu-1t", "cpu-1t"), "llama3-8b", SLO_MS, kinds[:1])
    assert same["threads_per_worker"] == 1 and "instances" not in same["decode"]


# ---- the model a written plan serves --------------------------------------------------------------
def test_a_model_serve_cannot_load_is_refused_with_the_forms_that_work():
    with pytest.raises(ValueError) as refused:
        check_serve_model(Namespace(model="facebook/opt-13b", serve_model=None))
    message = str(refused.value)
    for form in ("random:llama3-8b", ".gguf", "Hugging Face directory", "llama", DEFAULT_MODEL, "--serve-model"):
        assert form in message
    assert check_serve_model(Namespace(model="facebook/opt-13b", serve_model="random:llama3-8b")) == "random:llama3-8b"
    assert check_serve_model(Namespace(model=DEFAULT_MODEL, serve_model=None)) == DEFAULT_MODEL
    assert "random:llama3-8b" in model_spec_error("llama3-8b"), "a bare shape name is pointed to its random form"


def test_files_are_judged_by_what_they_hold(tmp_path):
    hf = tmp_path / "llama"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    opt = tmp_path / "opt"
    opt.mkdir()
    (opt / "config.json").write_text('{"model_type": "opt"}')
    gguf, other = tmp_path / "m.gguf", tmp_path / "m.bin"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    other.write_bytes(b"PK\x03\x04")
    assert model_spec_error(str(hf)) == "" and model_spec_error(str(gguf)) == ""
    assert "'opt'" in model_spec_error(str(opt))
    assert "not a GGUF" in model_spec_error(str(other))
    assert "not a known random shape" in model_spec_error("random:opt-13b")
    assert model_spec_error(str(tmp_path)) != "", "a directory without config.json"


def test_disagg_plan_refuses_an_unloadable_model_before_searching(capsys):
    from disagg.cli import main

    argv = ["plan", "--model", "facebook/opt-13b", "--hardware", "a100-80gb", "--cluster", "1x8"]
    argv += ["--slo", "ttft_ms=200,tpot_ms=100", "-o", "never-written.yaml"]
    assert main(argv) == 2
    assert "cannot load the model 'facebook/opt-13b'" in capsys.readouterr().err


def test_planning_opt_13b_without_output_still_works(tmp_path, capsys, monkeypatch):
    from disagg.cli import main

    best = disaggregated("a100-80gb", "a100-80gb")  # the search itself is test_search's
    monkeypatch.setattr(Search, "run", lambda self, target_rate=None, progress=None: [best])
    argv = ["plan", "--model", "facebook/opt-13b", "--hardware", "a100-80gb", "--cluster", "1x8"]
    argv += ["--slo", "ttft_ms=200,tpot_ms=100", "--json", str(tmp_path / "p.json")]
    assert main(argv) == 0, capsys.readouterr()
    assert (tmp_path / "p.json").is_file()
    written_too = argv + ["-o", str(tmp_path / "p.yaml"), "--serve-model", "random:llama2-13b"]
    assert main(written_too) == 0, capsys.readouterr()
    assert ServingConfig.from_yaml(str(tmp_path / "p.yaml")).engine.model == "random:llama2-13b"


# ---- a reference deployment beside the plan --------------------------------------------------------
def toy_search() -> Search:
    step = StepModel(Coefficients(2.0, 10.0, 0.0), Coefficients(50.0, 0, 0), Coefficients(50.0, 0, 0))
    profile = Profile("llama2-7b", "a100-80gb", "measured", {(1, 1): step, (2, 1): step}, 1000, 32)
    kind = NodeKind(hardware_spec("a100-80gb"), profile, num_nodes=1, devices_per_node=4)
    requests = [SimRequest(i, 0.0, 50, 10) for i in range(30)]
    slo = SLO(ttft_ms=2000.0, tpot_ms=200.0)
    return Search(model_spec("llama2-7b"), [kind], requests, slo, min_duration_s=1.0, rate_tolerance=0.2)


def test_compact_reference_specs_parse_and_bad_ones_are_refused():
    assert parse_reference("prefill=tp2x1,decode=tp1x1") == [
        ReferencePool("prefill", 2, 1, 1),
        ReferencePool("decode", 1, 1, 1),
    ]
    assert parse_reference("colocated=tp4pp2x3@l40s") == [ReferencePool("colocated", 4, 2, 3, "l40s")]
    for bad in ("prefill=tp2x1", "prefill=2x1,decode=tp1x1", "prefill=tp0x1,decode=tp1x1", "decode=tp1"):
        with pytest.raises(ValueError, match="compare"):
            parse_reference(bad)


def test_a_reference_config_keeps_its_pools_and_hardware(tmp_path):
    path = tmp_path / "ref.yaml"
    path.write_text(
        "prefill: {num_instances: 2, tensor_parallel_size: 2, resources: {a100-80gb: 0.001}}\n"
        "decode: {num_instances: 1, engine: {max_num_batched_tokens: 256}}\n"
    )
    prefill, decode = parse_reference(str(path))
    assert (prefill.role, prefill.tp, prefill.instances, prefill.hardware) == ("prefill", 2, 2, "a100-80gb")
    assert (decode.hardware, decode.engine["max_num_batched_tokens"]) == (None, 256)


def test_the_reference_is_simulated_like_a_candidate():
    search = toy_search()
    reference = reference_candidate(search, parse_reference("prefill=tp1x1,decode=tp2x1"))
    assert reference.algorithm == "reference" and reference.devices == 3 and reference.max_rate > 0
    assert (reference.pools["prefill"].scheduling_policy, reference.pools["decode"].tp) == ("prefill_first", 2)
    printed = comparison(reference, reference, "prefill=tp1x1,decode=tp2x1")
    assert "reference" in printed and "1.00x" in printed
    with pytest.raises(ValueError, match="h200"):
        reference_candidate(search, parse_reference("prefill=tp1x1@h200,decode=tp2x1"))


# ---- the shipped one-GPU configs beside a plan ------------------------------------------------------
DEPLOY_CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"


def plan_argv(compare: str) -> list[str]:
    argv = ["plan", "--model", "llama3-8b", "--hardware", "h200", "--cluster", "1x8"]
    return argv + ["--slo", "ttft_ms=400,tpot_ms=40", "--num-requests", "40", "--compare", compare]


@pytest.mark.parametrize("name", ["gpu-one.yaml", "gpu-one-colocated.yaml"])
def test_disagg_plan_takes_the_one_gpu_configs_as_its_reference(name, capsys, monkeypatch):
    from disagg.cli import main

    best = Candidate("colocated", {"colocated": PoolPlan(1, 1, 1, "h200", "chunked", 2048, 5000)}, 3.0, "colocated")
    monkeypatch.setattr(Search, "run", lambda self, target_rate=None, progress=None: [best])
    # The simulation itself is the next test's (90 s of arrivals at an H200's rates is minutes here).
    monkeypatch.setattr(Search, "max_rate", lambda self, pools, transfer, **checks: 2.5)
    assert main(plan_argv(str(DEPLOY_CONFIGS / name))) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "best plan beside the reference" in out and "h200" in out.split("best plan beside")[1], out


@pytest.mark.parametrize("name", ["gpu-one.yaml", "gpu-one-colocated.yaml"])
def test_the_one_gpu_configs_are_simulated_on_an_h200_roofline(name):
    from disagg.planner.roofline import roofline_profile

    h200 = hardware_spec("h200")
    kind = NodeKind(h200, roofline_profile("llama3-8b", h200), num_nodes=1, devices_per_node=8)
    requests = [SimRequest(i, 0.0, 400, 40) for i in range(30)]
    search = Search(model_spec("llama3-8b"), [kind], requests, SLO(400.0, 40.0), min_duration_s=1.0, rate_tolerance=0.3)
    reference = reference_candidate(search, parse_reference(str(DEPLOY_CONFIGS / name)))
    assert reference.max_rate > 0 and {p.hardware for p in reference.pools.values()} == {"h200"}


def test_disagg_plan_refuses_to_compare_a_config_whose_workers_do_not_fit(tmp_path, capsys, monkeypatch):
    from disagg.cli import main

    monkeypatch.setattr(Search, "run", lambda *a, **k: pytest.fail("searched before the config was checked"))
    unfit = tmp_path / "unfit.yaml"
    unfit.write_text(
        (DEPLOY_CONFIGS / "gpu-one.yaml").read_text().replace("42949672960", str(60 * 2**30))  # decode: 60 GiB of KV
    )
    assert main(plan_argv(str(unfit))) == 2
    err = capsys.readouterr().err
    assert "would not start" in err and "decode instance 0" in err and "60.00 GiB of KV cache" in err, err
    assert "prefill" not in err.split("would not start")[1], err


@pytest.mark.parametrize("hardware", ["a100-80gb", "l40s", "h200"])
@pytest.mark.parametrize("tp", [1, 2])
def test_a_written_plan_starts_its_workers_by_the_engines_memory_rule(hardware, tp, monkeypatch):
    """The search gives a pool of a model our engine runs the KV a worker may ask for and still
    start (its weights as the engine places them, a step's activations), so `disagg plan -o`
    writes what `disagg plan --compare` and the engine accept."""
    from disagg.planner.memory import config_fit_errors
    from disagg.planner.roofline import roofline_profile
    from disagg.planner.search import pool_plans

    monkeypatch.setenv("DISAGG_WEIGHTS", "auto")  # what a written config gets outside these tests
    spec = hardware_spec(hardware)
    kind = NodeKind(spec, roofline_profile("llama3-8b", spec, [(tp, 1)]), num_nodes=1, devices_per_node=8)
    search = Search(model_spec("llama3-8b"), [kind], [SimRequest(0, 0.0, 100, 10)], SLO(400.0, 40.0))
    pools = [search.pool("prefill", kind, tp, 1), search.pool("decode", kind, tp, 1)]
    candidate = Candidate("disaggregated", pool_plans(pools), 1.0, "test")
    config = ServingConfig.from_dict(serving_config_dict(candidate, "llama3-8b", SLO_MS, [kind]))
    assert config_fit_errors(config, model_spec("llama3-8b"), {"prefill": spec, "decode": spec}) == []
    assert all(p.num_kv_blocks * 16 > 100_000 for p in pools), "and most of the memory still holds KV"
