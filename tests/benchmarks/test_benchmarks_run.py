"""Every script under loadtest/ runs on a fresh clone (issue 38): each benchmark or tool at its
smallest configuration, as a user starts it (`python -m loadtest.<group>.<name>`, a subprocess of
its own, from the repository root, nothing added to its path), must exit 0 and print its figures.
A new script goes into SMOKE (how it runs small) or HELPERS (why it is not run on its own), or the
coverage test fails.

Runs that start a deployment, a Ray cluster or several default-model processes take 20 s to
minutes each on 2 cores: they are marked `bench_heavy`, which `make test` leaves out and
`make bench-smoke` (CI, after `make test`) runs. The others take seconds.

What a test cannot do is skipped, saying so: building llama.cpp (minutes), installing GuideLLM
(a virtual environment of its own), a CUDA device, DistServe's measured runs (outside the
repository). The part of those scripts that needs none of it runs all the same.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
LOADTEST = REPO / "loadtest"
DISTSERVE = REPO.parent / "shared" / "data" / "distserve"  # the default --data of the scripts that read it
GUIDELLM = REPO / ".venv-guidellm" / "bin" / "guidellm"
PROFILE_1T, PROFILE_2T = "deploy/profiles/smollm2-135m-cpu-1t.json", "deploy/profiles/smollm2-135m-cpu-2t.json"
# What a deployment of a smoke run differs in from the default one: no start-up calibration (up
# to 30 s of requests per server, which no smoke run measures).
SMOKE_SERVING = {"calibration_s": 0}
STOP_GRACE_S = 60  # after the timeout: SIGINT (the scripts stop their servers), then SIGKILL


@dataclass(frozen=True)
class Smoke:
    """One smoke run: `module` (loadtest.`module`, run with -m) with `args` ({tmp}: a directory of
    its own; {config}: a serving config with SMOKE_SERVING; {config_dir}: deploy/configs/ with it),
    whose output must match each of `figures` (regular expressions, one line each)."""

    module: str
    args: tuple[str, ...]
    figures: tuple[str, ...]
    timeout_s: float = 240
    heavy: bool = False  # a deployment, Ray, or the default model in several processes: bench_heavy
    skip: Callable[[], str | None] = lambda: None  # the reason it cannot run here, or None


def no_cuda() -> str | None:
    return None if torch.cuda.is_available() else "needs a CUDA device"


def no_distserve_data() -> str | None:
    return None if DISTSERVE.is_dir() else f"DistServe's measured runs are not at {DISTSERVE} (outside the repository)"


def no_llamacpp_build() -> str | None:
    llamacpp = importlib.import_module("loadtest.peers.llamacpp")
    if all(path.exists() for path in llamacpp.built_binaries().values()):
        return None
    return "llama.cpp is not built for this CPU (`make bench-llamacpp` builds it from source once, about 4 minutes)"


def no_guidellm() -> str | None:
    if GUIDELLM.exists():
        return None
    return "GuideLLM is not installed (`make bench-guidellm` installs it into .venv-guidellm)"


# fmt: off
SMOKE = {
    # ---- seconds: no deployment, no Ray ----
    "engine.throughput": Smoke("engine.throughput", (
        "--model", "random:tiny", "--num-requests", "2", "--max-batch", "2", "--min-prompt", "4", "--max-prompt", "8",
        "--min-output", "2", "--max-output", "4", "--threads", "1", "--out", "{tmp}/engine.json"),
        (r"^useful output tokens\s+\d+\s+\d+", r"^throughput ratio ours/HF\s+[\d.]+x")),
    "engine.fair_prefill": Smoke("engine.fair_prefill", ("--smoke", "--json", "{tmp}/fair.json"),
        (r"^fair: short ttft p50/max ms: \d+ / \d+; long ttft ms: \d+$", r"^bound ms: \d+$",
         r"^fair-tokens: short ttft p50/max ms: \d+ / \d+; long ttft ms: \d+$",
         r"^within bound: (yes|no) \(by tokens only: (yes|no)\)$",
         r"^long ttft ratio fair/off: [\d.]+ \(by tokens only: [\d.]+\)$")),
    "engine.gpu-cpu": Smoke("engine.gpu", (
        "--device", "cpu", "--model", "random:tiny", "--dtype", "float32", "--batches", "1,2", "--context", "8",
        "--steps", "1", "--prompt-tokens", "16", "--repeats", "1", "--kv-cache-gib", "0.01"),
        (r"^decode batch\s+2 ctx 8: step", r"^prefill 16 tokens: step")),
    "engine.gpu-cuda": Smoke("engine.gpu", (
        "--model", "random:tiny", "--batches", "1,2", "--context", "8", "--steps", "1", "--prompt-tokens", "16",
        "--repeats", "1", "--kv-cache-gib", "0.01"),
        (r"^decode batch\s+2 ctx 8: step", r"^prefill 16 tokens: step"), skip=no_cuda),
    "engine.batch_invariance": Smoke("engine.batch_invariance", ("--sides", ".", "--smoke"),
        (r"^\.: decode_tok_s@1 [\d.]+, decode_tok_s@2 [\d.]+, prefill_s@64 [\d.]+; 'The capital of France is Paris\.'$",)),
    "engine.decode_step": Smoke("engine.decode_step", (
        "--output-len", "8", "--repeats", "1", "--out", "{tmp}/decode_step.json"),
        (r"^fused\s+decode step\s+[\d.]+ ms", r"^unfused / fused step: [\d.]+x"), heavy=True),
    "engine.fp8": Smoke("engine.fp8", ("--batches", "1", "--repeats", "1", "--skip-engine"),
        (r"^\s*\w+ batch\s+1: bf16\s+[\d.]+ us\s+fp8\s+[\d.]+ us",), skip=no_cuda),
    "engine.triton_kernels": Smoke("engine.triton_kernels", ("--batch", "2", "--context", "16"),
        (r"triton\s+[\d.]+ us\s+torch\s+[\d.]+ us",), skip=no_cuda),
    "kv.ipc": Smoke("kv.ipc", (
        "--device", "cpu", "--dtype", "float32", "--tokens", "32", "--layers", "2", "--heads", "2", "--head-dim", "16",
        "--repeats", "1", "--check"),
        (r"^protocol/raw bandwidth: [\d.]+$", r"^mismatched transfers: 0$")),
    "engine.moe": Smoke("engine.moe", ("--smoke", "--json", "{tmp}/moe.json"),
        (r"^decode step ms @1: moe [\d.]+, dense [\d.]+$", r"^moe/dense ratio @1: [\d.]+ \(per-round",
         r"^target moe/dense <= 1.5 @1: (met|missed)$", r"^ep2/ep1 ratio @2: [\d.]+ \(per-round")),
    "engine.onednn_cache": Smoke("engine.onednn_cache", ("--prompts", "2", "--max-len", "16", "--capacities", "8"),
        (r"^\s+8\s+-?\d+\s+[\d.]+\s+[\d.]+",)),
    "router.placement_scale": Smoke("router.placement_scale", ("--smoke",),
        (r"^decision p99 ms @8x8: [\d.]+$", r"^decision p99 ms @64x64: [\d.]+$", r"^goodput ratio @8x8: [\d.]+$")),
    "planner.distserve": Smoke("planner.distserve", ("--smoke", "--data", str(DISTSERVE)),
        (r"^1\. DistServe's measured runs replayed", r"simulated requests per minute"), skip=no_distserve_data),
    "peers.vs_llamacpp-llamacpp": Smoke("peers.vs_llamacpp", (
        "--servers", "llama.cpp", "--threads", "1", "--streams", "1", "--min-requests", "1", "--requests-per-stream", "1",
        "--prompt-len", "16", "--max-tokens", "4", "--max-load", "1000", "--out-dir", "{tmp}"),
        (r"^\s+@1: [\d.]+ tok/s, TTFT p50 [\d.]+ s, 1 requests, 4 tokens",), skip=no_llamacpp_build),
    "kv.sliding_window": Smoke("kv.sliding_window", ("--smoke", "--json", "{tmp}/window.json"),
        (r"^windowed: KV bytes moved \d+; decode blocks reserved \d+, peak \d+",
         r"^KV bytes moved ratio windowed/full: 0\.8\d+$", r"^decode blocks held ratio windowed/full: 0\.8\d+$")),
    "planner.roofline": Smoke("planner.roofline", (
        "loadtest/results/gpu-h100/llama3-8b-h100-tp1.json", "--model", "llama3-8b", "--hardware", "h100-sxm",
        "--out", "{tmp}/roofline.json"),
        (r"^calibrated_on_held_out_points\s+\S+: median \|error\| [\d.]+%",)),
    "planner.fit_profiles": Smoke("planner.fit_profiles", ("--smoke", "--data", str(DISTSERVE)),
        (r"^distserve: \{'frontend_ms'", r"^vllm: \{'frontend_ms'"), skip=no_distserve_data),
    "peers.llamacpp": Smoke("peers.llamacpp", (), (r"^llama-server /", r"^llama-perplexity /"), skip=no_llamacpp_build),
    "host.cpu": Smoke("host.cpu", ("--size", "128", "--repeats", "1", "--copy-mb", "8", "--json", "{tmp}/cpu.json"),
        (r'"fp32_gflops_2t": [\d.]+', r'"copy_gb_s_2t": [\d.]+')),
    "planner.shifting_trace": Smoke("planner.shifting_trace", ("-o", "{tmp}/trace.json", "--phase-s", "2"),
        (r"^wrote .*trace\.json: \d+ requests over",)),
    # ---- bench_heavy: a deployment, Ray, or the default model in several processes ----
    "faults.flood": Smoke("faults.flood", (
        "--config", "{config}", "--clients", "8", "--limit", "2", "--baseline-clients", "4", "--baseline-limit", "1",
        "--max-tokens", "64", "--json", "{tmp}/flood.json"),
        (r"^clients: 8$", r"^refused: 6$", r"^refusal p99 ms: [\d.]+$", r"^serves after the flood: yes$",
         r"^target p99 <= 100 ms: (met|missed)$"), heavy=True),
    "loadgen.guidellm-scenario": Smoke("loadgen.guidellm", (
        "--scenario-only", "--config", "{config}", "--out-dir", "{tmp}", "--rates", "1", "--seconds", "2"),
        (r"^scenario: .*scenario\.json \(model \S+, SLO [^)]+\)$",), heavy=True),
    "loadgen.guidellm-run": Smoke("loadgen.guidellm", (
        "--guidellm", str(GUIDELLM), "--config", "{config}", "--out-dir", "{tmp}", "--rates", "1", "--seconds", "2",
        "--prompt-tokens", "16", "--output-tokens", "4"),
        (r"^GuideLLM's report: ",), heavy=True, skip=no_guidellm),
    "service.http_api": Smoke("service.http_api", (
        "--config", "{config}", "--streams", "1", "--requests", "2", "--rounds", "1", "--prompt-len", "8",
        "--max-tokens", "4"),
        (r"^1 streams: ttft p50 ratio http/grpc: [\d.]+$", r"^1 streams: throughput ratio http/grpc: [\d.]+$"),
        heavy=True),
    "kv.transfer": Smoke("kv.transfer", (
        "--tokens", "32", "--layers", "2", "--heads", "2", "--head-dim", "16", "--repeats", "1"),
        (r"^\(a\) raw send/recv, one contiguous tensor: +[\d.]+ GB/s", r"^\(b\) protocol, .*by reference.* ratio to raw",
         r"^\(b\) protocol, .*packed.* ratio to raw", r"^\(c\) default-model prefill of 32 tokens: .* ratio [\d.]+"),
        heavy=True),
    "kv.peer_fetch": Smoke("kv.peer_fetch", ("--model", "random:tiny", "--tokens", "64", "--repeats", "1"),
        (r"^peer fetch by reference: [\d.]+ MiB in [\d.]+ ms \(median\) against [\d.]+ ms computing it: [\d.]+x$",),
        heavy=True),
    "kv.multi_turn": Smoke("kv.multi_turn", (
        "--sessions", "1", "--turns", "4", "--first-tokens", "32", "--message-tokens", "16", "--answer-tokens", "2"),
        (r"^multi-turn ttft p50 ratio: [\d.]+$", r"^multi-turn hit rate: [\d.]+$"), heavy=True),
    "kv.live_migration": Smoke("kv.live_migration", ("--requests", "1", "--max-tokens", "64", "--move-after", "4"),
        (r"^requests: 1; moved with their KV: 1$", r"^migration pause p50 ms: -?[\d.]+", r"^decode step p50 ms: [\d.]+"),
        heavy=True),
    "service.memory": Smoke("service.memory", ("--kv-tokens", "256", "--requests", "1", "--skip-llamacpp",
        "--json", "{tmp}/memory.json"),  # llama-server's side: the llama.cpp run of peers.vs_llamacpp
        (r"^decode worker RSS, weights auto / fp32: [\d.]+$",), heavy=True),
    "engine.perplexity": Smoke("engine.perplexity", ("--windows", "1", "--json", "{tmp}/perplexity.json"),
        (r"^auto, prefill path: PPL [\d.]+", r"^auto, decode path: PPL [\d.]+", r"^fp32: PPL [\d.]+"),
        timeout_s=480, heavy=True),  # the decode path: 512 one-position steps, 130 s alone on a loaded 2-core host
    "planner.verify": Smoke("planner.verify", (
        "--smoke", "--config", "{config}", "--out", "{tmp}", "--workloads", "decode-heavy",
        "--profile-1t", PROFILE_1T, "--profile-2t", PROFILE_2T),
        (r"^\s+pick: measured \[\([\d.]+, [\d.]+\)\]", r"measured winner: "), heavy=True),
    "engine.quantized": Smoke("engine.quantized", ("--smoke", "--json", "{tmp}/quantized.json"),
        (r"^decode ratio auto/fp32 @1: [\d.]+$", r"^greedy agreement with fp32: \d+% of 1 outputs"), heavy=True),
    "planner.replan": Smoke("planner.replan", (
        "--config", "{config}", "--phase-s", "2", "--load", "0.5", "--prefill-capacity", "1", "--decode-capacity", "1",
        "--length-scale", "0.05", "--calibration-s", "0", "--json", "{tmp}/replan.json", "--logs", "{tmp}/logs"),
        (r"^replan goodput ratio: ", r"^wrong outputs: \d+$", r"^simulated replan goodput ratio: "),
        timeout_s=480, heavy=True),
    "planner.scaling": Smoke("planner.scaling", (  # two nodes: no room to grow, so nothing waits for a step
        "--config", "{config}", "--nodes", "2", "--up-rate", "1", "--up-s", "3", "--down-s", "2", "--calibration-s", "0",
        "--length-scale", "0.1", "--ttft-ms", "2000", "--timeout-s", "170", "--json", "{tmp}/scaling.json"),
        (r"^pools at +0\.0 s: 1P:1D$", r"^requests lost: 0$", r"^scaling grew: ", r"^scaling shrank: ",
         r"^scaling lost: 0$"), timeout_s=180, heavy=True),
    "router.scheduling": Smoke("router.scheduling", ("--smoke", "--config", "{config}", "--json", "{tmp}/sched.json"),
        (r"^load 8 x capacity [\d.]+ req/s = [\d.]+ req/s", r"^kendall tau: ", r"^mean latency ratio: ",
         r"^p99 latency ratio: ", r"^ttft p50 ratio: ", r"^tpot mape, router max_tokens: ", r"^tpot mape, router ranker: ",
         r"^attainment critical: "),
        timeout_s=600, heavy=True),
    "router.policies": Smoke("router.policies", (
        "--smoke", "--config", "{config}", "--phases", "prediction", "--seconds", "2", "--capacity-requests", "2",
        "--out", "{tmp}/router.json"),
        (r"^capacity [\d.]+ req/s; moderate load 0\.5 x capacity = [\d.]+ req/s$", r"^ttft mape: ", r"^tpot mape: "),
        heavy=True),
    "service.overhead": Smoke("service.overhead", (
        "--config", "{config}", "--requests", "2", "--max-tokens", "4", "--warmup", "1"),
        (r"^service adds [-+][\d.]+ ms to p50 TTFT", r"^TPOT p50 ratio [\d.]+"), heavy=True),
    "service.shard_step": Smoke("service.shard_step", ("--steps", "2", "--rounds", "1", "--out", "{tmp}"),
        (r"^this tree\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+-?[\d.]+\s+-?[\d.]+$",), heavy=True),
    "planner.simulator": Smoke("planner.simulator", (
        "--quick", "--modes", "disaggregated", "--loads", "1", "--capacity-requests", "2", "--num-requests", "2",
        "--num-unloaded", "2", "--config-dir", "{config_dir}", "--out-dir", "{tmp}"),
        (r"load 1 x capacity [\d.]+ req/s", r"^disaggregated\s+[\d.]+\s+[\d.]+/[\d.]+", r"^same order: "),
        heavy=True),
    "service.structured": Smoke("service.structured", (
        "--config", "{config}", "--streams", "1", "--requests", "1", "--rounds", "1", "--max-tokens", "4"),
        (r"^tpot ratio schema/free \(mask only", r"^long-key outputs identical with and without jump-forward: True$",
         r"^e2e ratio jump-forward/without \(long keys\): [\d.]+$"), timeout_s=360, heavy=True),
    "peers.vs_llamacpp-disagg": Smoke("peers.vs_llamacpp", (
        "--servers", "disagg", "--streams", "1", "--min-requests", "1", "--requests-per-stream", "1",
        "--prompt-len", "16", "--max-tokens", "4", "--max-load", "1000", "--out-dir", "{tmp}"),
        (r"^\s+@1: [\d.]+ tok/s, TTFT p50 [\d.]+ s, 1 requests, 4 tokens",), heavy=True),
    "faults.cancel_storm": Smoke("faults.cancel_storm", (
        "--config", "{config}", "--total", "6", "--concurrency", "2", "--max-tokens", "16", "--out", "{tmp}/storm.json"),
        (r"^ended: 6$", r"^leaked blocks: \d+$", r"^refused after: \d+$"), heavy=True),
    "faults.chaos": Smoke("faults.chaos", (
        "--config", "{config}", "--minutes", "0.2", "--kill-every", "5", "--concurrency", "1", "--max-tokens", "4",
        "--out", "{tmp}/chaos.json"),
        (r"^killed .*: recovered in [\d.]+ s", r"^lost: \d+$", r"^wrong outputs: \d+$", r"^recovery p50 s: [\d.]+$"),
        heavy=True),
    "faults.chaos-frontends": Smoke("faults.chaos", (
        "--config", "{config}", "--minutes", "0.3", "--kill-every", "0", "--warm-up", "0", "--frontends", "2",
        "--kill-frontend-every", "6", "--concurrency", "2", "--max-tokens", "4", "--out", "{tmp}/chaos.json"),
        (r"^killed frontend .*: recovered in [\d.]+ s", r"^frontends 2: \d+ killed, \d+ requests retried",
         r"^lost: \d+$", r"^leaked blocks: \d+$", r"^frontend recovery p50 s: [\d.]+$"), heavy=True),
    "faults.chaos-controller": Smoke("faults.chaos", (
        "--config", "{config}", "--minutes", "0.4", "--kill-every", "0", "--warm-up", "0", "--frontends", "2",
        "--kill-controller-every", "8", "--concurrency", "2", "--max-tokens", "4", "--out", "{tmp}/chaos.json"),
        (r"^killed the controller \(pid \d+\): back in [\d.]+ s", r"^lost: \d+$", r"^leaked blocks: \d+$",
         r"^controller kills: \d+, back within s: [\d.]+$"), heavy=True),
    "faults.chaos-serve": Smoke("faults.chaos", (
        "--config", "{config}", "--minutes", "0.4", "--kill-every", "0", "--warm-up", "0", "--frontends", "2",
        "--kill-serve-every", "8", "--concurrency", "2", "--max-tokens", "4", "--out", "{tmp}/chaos.json"),
        (r"^killed disagg serve \(pid \d+\): attached again in [\d.]+ s", r"^lost: \d+$", r"^leaked blocks: \d+$",
         r"^disagg serve kills: \d+, back within s: [\d.]+$"), heavy=True),
    "faults.fuzz": Smoke("faults.fuzz", (
        "--config", "{config}", "--requests", "20", "--fuzz-clients", "2", "--innocent-clients", "1", "--max-tokens", "4",
        "--cases", "^(?!ids at limit)", "--out", "{tmp}/fuzz.json"),  # that one prefills 8k tokens
        (r"^fuzz requests: 20$", r"^unexpected codes: \d+$", r"^answers after: yes$",
         r"^innocent ttft p99 s behind a max-length prompt / without: (nan|[\d.]+) / [\d.]+$"), heavy=True),
    "host.sharing": Smoke("host.sharing", ("--steps", "1", "--rounds", "1"),
        (r'"slowdown": \{',), heavy=True),
    "loadgen.run_locust": Smoke("loadgen.run_locust", (
        "--config", "{config}", "--users", "1", "--spawn-rate", "1", "--run-time", "12s", "--out-dir", "{tmp}",
        "--", "--workload-size", "4", "--length-scale", "0.1", "--max-tokens", "4", "--think-time", "0"),
        (r"^SLO attainment, goodput, TTFT/TPOT percentiles: ", r"^report: .*table\.md"), heavy=True),
}
# fmt: on

HELPERS = {
    "loadgen.locustfile": "Locust's users and options: loadgen.run_locust runs it",
    "loadgen.locust_slo": "a Locust plugin (the SLO figures) that the locustfile loads",
    "kv.transfer_actors": "the raw-bandwidth actors of kv.transfer, which measures with them",
}


def modules_under_loadtest() -> set[str]:
    """Every module of loadtest's groups, as `group.name` (the packages' __init__ left out)."""
    return {f"{p.parent.name}.{p.stem}" for p in LOADTEST.glob("*/*.py") if p.name != "__init__.py"}


def test_every_script_under_loadtest_has_a_smoke_run_or_says_why_not():
    modules = modules_under_loadtest()
    covered = {smoke.module for smoke in SMOKE.values()} | set(HELPERS)
    assert not modules - covered, f"add a smoke run (SMOKE) or a reason (HELPERS) for {sorted(modules - covered)}"
    assert not covered - modules, f"no such scripts any more: {sorted(covered - modules)}"
    assert not {smoke.module for smoke in SMOKE.values()} & set(HELPERS)
    assert [p.name for p in LOADTEST.glob("*.py")] == ["__init__.py"], "scripts live in groups: loadtest/<group>/"


def test_no_script_edits_its_path_or_asks_for_one():
    """`python -m` from the repository root finds disagg and loadtest: nothing else is needed."""
    for path in LOADTEST.glob("*/*.py"):
        text = path.read_text()
        assert "sys.path.insert" not in text and "sys.path.append" not in text, f"{path} edits sys.path"
        assert "PYTHONPATH=." not in text, f"{path} asks for PYTHONPATH=."


@pytest.fixture(scope="module")
def smoke_configs(tmp_path_factory) -> dict[str, str]:
    """{config}: SMOKE_SERVING alone; {config_dir}: each of deploy/configs/ with SMOKE_SERVING over it."""
    root = tmp_path_factory.mktemp("smoke-configs")
    config = root / "smoke.yaml"
    config.write_text(yaml.safe_dump(SMOKE_SERVING))
    config_dir = root / "configs"
    config_dir.mkdir()
    for source in (REPO / "deploy" / "configs").glob("*.yaml"):
        (config_dir / source.name).write_text(
            yaml.safe_dump({**(yaml.safe_load(source.read_text()) or {}), **SMOKE_SERVING})
        )
    return {"config": str(config), "config_dir": str(config_dir)}


def marks(smoke: Smoke) -> list:
    timeout = pytest.mark.timeout(smoke.timeout_s + 2 * STOP_GRACE_S)
    return [timeout, pytest.mark.bench_heavy] if smoke.heavy else [timeout]


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(name, marks=marks(smoke)) for name, smoke in SMOKE.items()])
def test_the_benchmark_runs_at_its_smallest_configuration(name, smoke_configs, tmp_path):
    smoke = SMOKE[name]
    module = f"loadtest.{smoke.module}"
    reason = smoke.skip()
    if reason:
        pytest.skip(f"{module}: {reason}")
    args = [arg.format(tmp=tmp_path, **smoke_configs) for arg in smoke.args]
    code, output = run_module(module, args, smoke.timeout_s)
    assert code == 0, f"{module} {' '.join(args)} exited with {code}:\n{output[-6000:]}"
    missing = [figure for figure in smoke.figures if not re.search(figure, output, re.MULTILINE)]
    assert not missing, f"{module} printed none of {missing}:\n{output[-6000:]}"


def run_module(module: str, args: list[str], timeout_s: float) -> tuple[int, str]:
    """(exit code, stdout and stderr) of `python -m module` run as a user runs it: from the
    repository root, with no PYTHONPATH (under -m the working directory is on the path, so this
    checkout's disagg and loadtest are found first). Past its timeout it is interrupted (SIGINT:
    its `finally` blocks stop what it started), then killed."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        output = stop(process)
        pytest.fail(f"{module} {' '.join(args)} ran past {timeout_s:.0f} s:\n{output[-6000:]}")
    return process.returncode, output


def stop(process: subprocess.Popen) -> str:
    os.killpg(process.pid, signal.SIGINT)
    try:
        output, _ = process.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    return output
