"""The GPU kit cannot rot while no GPU is at hand (issue 48): `make gpu-kit`'s builder makes the
kit for this machine's Python (a GPU machine's is 3.12; the wheels are per version), then
deploy/gpu/run_all.py --dry-run installs it into a folder of its own and runs its whole check
list here, small, on the CPU, as it runs on a GPU: `disagg serve` answering "Paris", KV between two
processes, both one-GPU configs under `disagg bench` at each rate, `disagg profile`, the planner's
predictions. The service runs on the kit's Ray, grpcio, Redis client and redis-server (its site
first on the path, redis-server first on PATH); the GPU-only stages say "skipped: no GPU".

Building needs pip's registry and Debian's; where they cannot be reached the test says so and
skips. The model's parts are left out (98 MB to copy; tests/unit/test_gpu_kit.py splits and joins
a stand-in): the dry run's "Paris" comes from the default model installed here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NETWORK_FAILURE = re.compile(
    r"Temporary failure in name resolution|Could not resolve|Failed to fetch|Network is unreachable|"
    r"Connection refused|ConnectionError|NewConnectionError|timed out|No such file or directory: '(apt-get|dpkg-deb)'"
)
FROM_THE_KIT = ("ray", "grpc", "google.protobuf", "grpc_health", "redis", "jsonschema", "gguf", "llguidance")
GPU_ONLY = ("gpu_tests", "gpu_engine", "fp8_triton")
NOT_IN_A_DRY_RUN = ("kv_transfer",)  # its own smoke run: test_benchmarks_run.py

pytestmark = [pytest.mark.bench_heavy, pytest.mark.slow, pytest.mark.timeout(1200)]


def run(argv: list[str], timeout_s: float) -> tuple[int, str]:
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpu-kit") / "kit"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    argv = [sys.executable, "deploy/gpu/build_kit.py", "--out", str(folder), "--python-version", version, "--no-model"]
    code, output = run(argv, timeout_s=600)
    if code and NETWORK_FAILURE.search(output):
        pytest.skip(f"the kit cannot be built without pip's and Debian's registries:\n{output[-1500:]}")
    assert code == 0, output[-6000:]
    largest = re.search(r"^gpu kit MiB: ([\d.]+)$", output.strip().splitlines()[-1])
    assert largest and float(largest.group(1)) < 64, output
    return folder


@pytest.fixture(scope="module")
def dry_run(kit, tmp_path_factory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("gpu-dry-run")
    out = root / "out"
    argv = [sys.executable, "deploy/gpu/run_all.py", "--dry-run", "--kit", str(kit), "--target", str(root / "kit")]
    code, output = run(argv + ["--out", str(out)], timeout_s=900)
    assert code == 0, output[-6000:]
    return json.loads((out / "summary.json").read_text()), out


def stage(summary: dict, name: str) -> dict:
    return next(record for record in summary["stages"] if record["name"] == name)


def test_every_stage_passes_or_says_why_it_cannot_run_here(dry_run):
    summary, out = dry_run
    assert summary["install"]["status"] == "ok" and summary["install"]["tokenizer"]
    for record in summary["stages"]:
        if record["name"] in GPU_ONLY:
            assert record["status"] == "skipped: no GPU", record
        elif record["name"] in NOT_IN_A_DRY_RUN:
            assert record["status"].startswith("skipped:"), record
        else:
            assert record["status"] == "ok", f"{record}\n{(out / 'stages.log').read_text()[-6000:]}"


def test_the_service_runs_on_what_the_kit_installed(dry_run):
    summary, _ = dry_run
    packages = stage(summary, "env")["figures"]["packages"]
    assert {name: packages[name].get("from") for name in FROM_THE_KIT} == dict.fromkeys(FROM_THE_KIT, "kit")
    assert stage(summary, "env")["figures"]["redis_server"].startswith("Redis server v=")
    assert str(Path(summary["install"]["bin"][-1])) in summary["install"]["bin"][-1]  # redis/bin, first on PATH
    assert "Paris" in stage(summary, "paris")["figures"]["answer"]


def test_both_configs_are_measured_at_every_rate_beside_the_planners_prediction(dry_run):
    summary, _ = dry_run
    comparison = stage(summary, "planner")["figures"]["comparison"]
    assert set(comparison) == {"disagg", "colocated"}
    for mode, rates in comparison.items():
        assert len(rates) >= 2, mode
        for rate, pair in rates.items():
            for side in ("measured", "predicted"):
                assert 0 <= pair[side]["attainment_pct"] <= 100 and pair[side]["goodput"] >= 0, (mode, rate, pair)
    assert stage(summary, "kv_ipc")["figures"]["mismatched_transfers"] == 0


def test_what_comes_back_fits_the_device_tools_limits(dry_run):
    """At most 8 files of at most 16 MiB each come back from $OUT, 2 folders deep at most."""
    summary, out = dry_run
    files = [path for path in out.rglob("*") if path.is_file()]
    assert len(files) <= 8 and all(path.stat().st_size <= 16 * 2**20 for path in files), files
    assert Path(stage(summary, "profile")["figures"]["path"]).parent == out
    assert {"summary.json", "stages.log", "work.tar.gz"} <= {path.name for path in files}
