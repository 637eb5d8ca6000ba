"""The GPU check list of issue 48 in one device call of at most 9 minutes: installs the kit of
`make gpu-kit` (deploy/gpu/install_kit.py), then runs, in this order, each stage with its own
time limit, while the budget lasts:

  env                the GPU, the driver, and which packages come from the kit
  gpu_tests          tests/gpu (not the slow ones)
  paris              `disagg serve` (the default model, the default config, on the GPU) answers
                     "What is the capital of France?" through `disagg generate --server`: Paris
  kv_ipc             KV between two processes on one GPU (loadtest.kv.ipc): its
                     bandwidth against one contiguous copy (target >= 0.8)
  kv_transfer        loadtest.kv.transfer: raw, the protocol, and the streaming
                     overhead on a prefill (target <= 1.05)
  service_disagg     deploy/configs/gpu-one.yaml (1 prefill + 1 decode on the GPU) and
  service_colocated  gpu-one-colocated.yaml (1 instance): `disagg bench` at three rates each
                     (random Llama-3-8B weights, bf16, the default tokenizer): attainment, goodput
  profile            `disagg profile` of random:llama3-8b on the GPU, into $OUT (for deploy/profiles/)
  planner            `disagg simulate` of both configs at the same rates with that profile:
                     predicted attainment and goodput beside the measured ones
  gpu_engine         loadtest.engine.gpu (decode bandwidth, prefill FLOP use)
  fp8_triton         the Triton kernels against torch (loadtest.engine.triton_kernels), FP8
                     weights against bf16 (loadtest.engine.fp8): GEMM time, decode throughput,
                     greedy agreement

$OUT gets summary.json (each stage's status and figures, rewritten after each stage),
stages.log (every command's output), the profile, and work.tar.gz (configs, logs, the
benchmarks' JSON). On the GPU machine, from the repository root (docs/deploy.md: "On a GPU"):

    python3 deploy/gpu/run_all.py
    .venv/bin/python deploy/gpu/run_all.py --dry-run --kit DIR --out DIR   # the same on a CPU, small (tests/benchmarks)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import gpu_checks
import install_kit
from stage_runner import REPO, Context, Stage, run_stages

MiB = 2**20
POOLS_SHARING_ONE_GPU = ("prefill", "decode")  # the default config's, for "Paris" on the GPU
GPU_BUDGET_S = 510.0  # the call's 9 minutes, less time for a server's stop past its stage and the archive
DRY_RUN_BUDGET_S = 300.0
STAGES = (  # in priority order: what runs first is what matters most when time runs short
    Stage("env", gpu_checks.env, limit_s=60, min_s=5),
    Stage("gpu_tests", gpu_checks.gpu_tests, limit_s=70, min_s=30, needs_gpu=True),
    Stage("paris", gpu_checks.paris, limit_s=100, min_s=40),
    Stage("kv_ipc", gpu_checks.kv_ipc, limit_s=40, min_s=15),
    Stage("kv_transfer", gpu_checks.kv_transfer, limit_s=70, min_s=30),
    Stage("service_disagg", gpu_checks.service("disagg"), limit_s=150, min_s=60),
    Stage("service_colocated", gpu_checks.service("colocated"), limit_s=150, min_s=60),
    Stage("profile", gpu_checks.profile, limit_s=60, min_s=25),
    Stage("planner", gpu_checks.planner, limit_s=40, min_s=10),
    Stage("gpu_engine", gpu_checks.gpu_engine, limit_s=70, min_s=40, needs_gpu=True),
    Stage("fp8_triton", gpu_checks.fp8_triton, limit_s=40, min_s=25, needs_gpu=True),
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the stages run: on the GPU, or small on a CPU (--dry-run)."""

    kit_site: str
    tokenizer: str | None  # the kit's tokenizer folder (None: part a is not here)
    service_configs: dict  # stage mode -> deploy/configs/<name>.yaml
    rates: tuple[float, ...]
    seconds_per_rate: float  # of arrivals at each rate
    min_requests: int
    length_scale: float
    max_model_len: int
    request_timeout_s: float
    slo: str | None  # None: each config's own
    seed_profile: str  # the servers' latency models start from it; the planner's when no profile was measured
    config_changes: dict  # over each served config
    engine_changes: dict
    pool_changes: dict
    paris_changes: dict  # over deploy/configs/disaggregated.yaml
    kv_ipc_args: tuple[str, ...]
    kv_transfer_args: tuple[str, ...] | None  # None: not run
    profile_args: tuple[str, ...]
    profile_name: str  # {gpu}: the GPU's short name
    pytest_test_timeout_s: int


def gpu_settings(installed: dict, rates: tuple[float, ...] | None) -> Settings:
    no_port = {"calibration_s": 0, "http_port": 0, "metrics_port": None}
    half_gpu = {"num_gpus_per_worker": 0.5}
    return Settings(
        kit_site=installed["site"],
        tokenizer=installed["tokenizer"],
        service_configs={"disagg": "gpu-one", "colocated": "gpu-one-colocated"},
        rates=rates or (2.0, 4.0, 8.0),
        seconds_per_rate=12.0,
        min_requests=8,
        length_scale=0.5,  # ShareGPT-shaped lengths halved: the longest answer (512 tokens) ends in seconds
        max_model_len=8192,
        request_timeout_s=60.0,
        slo=None,
        seed_profile="loadtest/results/gpu-h200/llama3-8b-h200-tp1.json",
        config_changes={},
        # The kit's tokenizer folder (part a), not the config's GGUF name: the service stages then
        # need none of the model's parts, which a machine gone cold between calls loses.
        engine_changes=_kit_tokenizer(installed),
        pool_changes={},
        # float32 as tests/gpu's default-model test: the answer's first token is a near-tie ("The" or "L'")
        paris_changes={
            **no_port,
            "engine": {"device": "cuda", "dtype": "float32"},
            **dict.fromkeys(POOLS_SHARING_ONE_GPU, half_gpu),
        },
        kv_ipc_args=("--device", "cuda", "--repeats", "10"),
        kv_transfer_args=("--device", "cuda", "--dtype", "bfloat16", "--repeats", "5"),
        profile_args=tuple(
            "--model random:llama3-8b --device cuda --dtype bfloat16 --tp-pp 1x1 --max-prompt-len 2048 "
            "--max-batch 64 --repeats 2".split()
        ),
        profile_name="llama3-8b-{gpu}-tp1.json",
        pytest_test_timeout_s=50,
    )


def dry_run_settings(installed: dict, rates: tuple[float, ...] | None) -> Settings:
    """The same stages on this CPU, small: the default model's random-weight shape in float32."""
    tiny_kv = tuple("--tokens 32 --layers 2 --heads 2 --head-dim 16 --repeats 1".split())
    return dataclasses.replace(
        gpu_settings(installed, rates or (1.0, 4.0)),
        seconds_per_rate=1.0,
        min_requests=2,
        length_scale=0.02,
        slo="ttft_ms=30000,tpot_ms=3000",
        seed_profile="deploy/profiles/smollm2-135m-cpu-1t.json",
        # The router sheds what it predicts will miss the config's SLO: the GPU's would shed most here.
        config_changes={"threads_per_worker": 1, "slo": {"ttft_ms": 30000, "tpot_ms": 3000}},
        engine_changes=dict(
            _kit_tokenizer(installed),
            model="random:smollm2-135m",
            dtype="float32",
            device="cpu",
            kv_cache_memory_bytes=64 * MiB,
            num_kv_blocks=None,
        ),
        pool_changes={"num_gpus_per_worker": 0, "num_cpus_per_worker": 1},
        paris_changes={"calibration_s": 0, "http_port": 0, "metrics_port": None, "engine": {"device": "cpu"}},
        kv_ipc_args=("--device", "cpu", "--dtype", "float32", *tiny_kv),
        kv_transfer_args=None,  # a minute here; its own smoke run is in `make bench-smoke`
        # A profile of the smallest shape (the planner's numbers mean nothing here, its steps run).
        profile_args=tuple("--model random:tiny --device cpu --dtype float32 --tp-pp 1x1 --threads 1 --quick".split()),
        profile_name="tiny-cpu-dry-run.json",
    )


def _kit_tokenizer(installed: dict) -> dict:
    return {"tokenizer": installed["tokenizer"]} if installed["tokenizer"] else {}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="on this CPU, small; the GPU-only stages skipped")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu-out", help="default: $OUT")
    p.add_argument("--kit", default=str(REPO / ".gpu"), help="the parts of `make gpu-kit`")
    p.add_argument("--target", default=str(install_kit.DEFAULT_TARGET), help="where the kit is installed")
    p.add_argument(
        "--budget-s",
        type=float,
        help=f"wall time of the stages (default {GPU_BUDGET_S:g}; dry run {DRY_RUN_BUDGET_S:g})",
    )
    p.add_argument("--rates", help="comma-separated request rates of the service stages")
    p.add_argument("--only", help="comma-separated stages to run (the others are skipped)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = selected(args.only)
    started = time.monotonic()
    out, target = Path(args.out), Path(args.target)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"dry_run": args.dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    installed = install(Path(args.kit), target, summary)
    rates = tuple(float(r) for r in args.rates.split(",")) if args.rates else None
    settings = (dry_run_settings if args.dry_run else gpu_settings)(installed, rates)
    ctx = context(out, target / "run", installed, settings, args.dry_run)
    budget = (args.budget_s or (DRY_RUN_BUDGET_S if args.dry_run else GPU_BUDGET_S)) - (time.monotonic() - started)
    summary = run_stages(chosen, ctx, budget, has_gpu=not args.dry_run and gpu_present(), summary=summary)
    archive(ctx.work, out / "work.tar.gz")
    print_table(summary)
    return 0


def install(kit: Path, target: Path, summary: dict) -> dict:
    """The kit, installed; what failed is in the summary, and the stages run all the same."""
    started = time.monotonic()
    try:
        installed = install_kit.install(kit, target)
        status = "ok"
    except Exception as exc:  # pip, a broken archive, a wrong piece: the stages say what it costs
        installed = {"site": str(target / "site"), "bin": [], "tokenizer": None, "model": None, "notes": []}
        status = f"failed: {exc}"
    summary["install"] = {"status": status, "seconds": round(time.monotonic() - started, 1), **installed}
    print(f"[install] {status}: {json.dumps(installed)}", flush=True)
    return installed


def context(out: Path, work: Path, installed: dict, settings: Settings, dry_run: bool) -> Context:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (out / "stages.log").write_text("")
    env = install_kit.child_env(installed)
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if dry_run:
        env.update(OMP_NUM_THREADS="1")
    return Context(out=out, work=work, env=env, settings=settings, python=sys.executable)


def selected(only: str | None) -> list[Stage]:
    if not only:
        return list(STAGES)
    names = {name.strip() for name in only.split(",")}
    unknown = names - {stage.name for stage in STAGES}
    if unknown:
        raise SystemExit(f"--only: no stage {sorted(unknown)}; stages: {', '.join(s.name for s in STAGES)}")
    return [stage for stage in STAGES if stage.name in names]


def gpu_present() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0


def archive(work: Path, dest: Path) -> None:
    """Configs, logs and the benchmarks' JSON in one file ($OUT returns few files)."""
    with tarfile.open(dest, "w:gz") as tar:
        tar.add(work, arcname="work")


def print_table(summary: dict) -> None:
    print(f"\n{'stage':<18} {'seconds':>8}  status")
    for record in summary["stages"]:
        print(f"{record['name']:<18} {record['seconds']:>8}  {record['status'][:150]}")
    table = next((r["figures"].get("comparison") for r in summary["stages"] if r["name"] == "planner"), None)
    for mode, rates in (table or {}).items():
        for rate, pair in rates.items():
            print(f"{mode:<10} rate {rate:>4}: measured {pair['measured']}  predicted {pair['predicted']}")
    print(f"summary: {summary.get('elapsed_s')} s of stages")


if __name__ == "__main__":
    sys.exit(main())
