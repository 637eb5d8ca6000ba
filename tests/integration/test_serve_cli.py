"""`disagg serve` started as a new user would (no arguments), then `disagg generate --server`.

Runs the real commands as subprocesses: the server starts its own Ray and redis-server, and
everything it started must be gone after SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest


from disagg.server import RAY_TOKEN_FILE

BIN = Path(sys.executable).parent / "disagg"
START_TIMEOUT_S = 180
PROFILE_1T = Path(__file__).parents[2] / "deploy" / "profiles" / "smollm2-135m-cpu-1t.json"


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    proc, address, log = _serve(tmp_path_factory.mktemp("serve"))
    yield proc, address, log
    if proc.poll() is None:
        proc.kill()


def _serve(workdir: Path, *args: str) -> tuple[subprocess.Popen, str, Path]:
    ready, log_path = workdir / "ready", workdir / "serve.log"
    # Its own session, like a service: the test's signals don't reach it, and we can find its tree.
    with open(log_path, "w") as log:  # the server has its own copy of the file
        proc = subprocess.Popen(
            [str(BIN), "serve", "--ready-file", str(ready), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "DISAGG_STATE_DIR": str(workdir / "state")},  # its own record of its deployment
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists() or not ready.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"disagg serve did not start: {log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, ready.read_text().strip(), log_path


def test_generate_against_the_default_server_answers_sensibly(default_server):
    _, address, _ = default_server
    assert address == "127.0.0.1:50051", "the default listens on 127.0.0.1:50051"
    result = subprocess.run(
        [str(BIN), "generate", "--server", address, "What is the capital of France?"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="what the default does on a machine of two CPUs")
def test_the_default_server_also_serves_the_openai_api_on_port_8000_and_says_so(default_server):
    _, _, log = default_server
    assert "OpenAI-compatible API on http://127.0.0.1:8000/v1" in log.read_text()
    with urllib.request.urlopen("http://127.0.0.1:8000/v1/models", timeout=10) as reply:
        assert json.load(reply)["data"][0]["id"] == "smollm2-135m-instruct"


def test_rays_token_file_is_readable_by_its_owner_only(default_server):
    if not RAY_TOKEN_FILE.exists():
        pytest.skip("this Ray keeps no token file")
    assert RAY_TOKEN_FILE.stat().st_mode & 0o077 == 0, f"{RAY_TOKEN_FILE} is readable by other users"


def test_on_two_cpus_the_default_binds_no_thread(default_server):
    """cpu_binding auto leaves two CPUs to everything but the engines: with two there are none to give."""
    proc, _, _ = default_server
    cpus = os.sched_getaffinity(0)
    bound = {
        name: sets
        for name, sets in _affinities(os.getsid(proc.pid)).items()
        if any(allowed != cpus for allowed in sets)
    }
    assert not bound, f"threads bound to fewer CPUs than the machine has: {bound}"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to give one to the prefill engine")
def test_with_binding_on_the_prefill_engine_thread_has_a_cpu_that_no_other_thread_of_the_deployment_uses(tmp_path):
    """cpu_binding on: the prefill engine on the last CPU; Ray, Redis, the frontend and the
    workers' other threads on the rest; the decode engine anywhere."""
    from disagg.bench.launcher import free_port

    config = tmp_path / "bound.yaml"
    config.write_text("cpu_binding: on\nmetrics_port: null\ncalibration_s: 0\n")  # (calibration: not what it checks)
    proc, _, _ = _serve(tmp_path, "--config", str(config), "--port", str(free_port()), "--http-port", "0")
    cpus = os.sched_getaffinity(0)
    engine_cpu = max(cpus)
    try:
        # Threads an engine thread started (the warm-up's KV channel, gloo's) inherited its CPUs
        # until the worker's next heartbeat moves them: allow a few.
        deadline = time.monotonic() + 10
        while True:
            on_it = {
                name: [allowed for allowed in sets if engine_cpu in allowed]
                for name, sets in _affinities(os.getsid(proc.pid)).items()
            }
            on_it = {name: sets for name, sets in on_it.items() if sets}
            if sum(len(sets) for sets in on_it.values()) <= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    # Both workers' processes are titled ray::WorkerActor (either may switch roles): of their
    # threads, one (the prefill engine's) runs only on that CPU, one (the decode engine's) anywhere.
    workers = [allowed for name, sets in on_it.items() if "Actor" in name for allowed in sets]
    assert sorted(workers, key=len) == [{engine_cpu}, cpus], (
        f"the prefill engine alone there, the decode one anywhere: {on_it}"
    )
    assert sum(len(sets) for sets in on_it.values()) == 2, f"nothing else may run there: {on_it}"


def test_a_plan_written_by_disagg_plan_starts_under_disagg_serve(tmp_path):
    """`disagg plan -o` on this machine's measured profile, then `disagg serve --config` on its output:
    the planned mode and pools come up and answer."""
    import yaml

    from disagg.bench.launcher import free_port

    plan = tmp_path / "plan.yaml"
    planned = subprocess.run(
        [str(BIN), "plan", "--model", "smollm2-135m-instruct", "--profile", str(PROFILE_1T), "--cluster", "1x2",
         "--workload", "chat", "--slo", "ttft_ms=2000,tpot_ms=200", "--num-requests", "100", "-o", str(plan)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert planned.returncode == 0, planned.stdout + planned.stderr
    config = yaml.safe_load(plan.read_text())
    assert config["threads_per_worker"] == 1, "a 1-thread profile plans 1-thread workers"
    with plan.open("a") as f:  # (placement's calibration at start: test_calibration.py's)
        f.write("calibration_s: 0\n")
    proc, address, _ = _serve(tmp_path, "--config", str(plan), "--port", str(free_port()), "--http-port", "0")
    try:
        status = subprocess.run([str(BIN), "status", "--server", address], capture_output=True, text=True, timeout=60)
        answer = subprocess.run(
            [str(BIN), "generate", "--server", address, "What is the capital of France?"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert status.returncode == 0, status.stderr
    assert config["mode"] in status.stdout, status.stdout
    for role in ("prefill", "decode", "colocated"):
        if role in config:
            assert status.stdout.count(role) >= config[role]["num_instances"], status.stdout
    assert answer.returncode == 0, answer.stderr
    assert "Paris" in answer.stdout


def _affinities(session: int) -> dict[str, list[set[int]]]:
    """Each process of the session (by command line) -> the CPU sets of its threads."""
    found = {}
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        if _session_of(p) != session:
            continue
        for thread in p.threads():
            try:
                allowed = os.sched_getaffinity(thread.id)
            except OSError:
                continue  # ended meanwhile
            found.setdefault(" ".join(p.info["cmdline"] or [p.info["name"]]), []).append(allowed)
    return found


def test_sigterm_stops_cleanly_and_leaves_no_process(default_server):
    proc, _, log = default_server
    session = os.getsid(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 20
    while True:
        left = [p for p in psutil.process_iter(["pid", "name"]) if _session_of(p) == session]
        if not left:
            break
        assert time.monotonic() < deadline, f"left running: {[(p.pid, p.info['name']) for p in left]}"
        time.sleep(0.5)
    assert "disagg: stopped" in log.read_text()


def _session_of(p: psutil.Process) -> int | None:
    try:
        return os.getsid(p.pid) if p.status() != psutil.STATUS_ZOMBIE else None
    except (psutil.Error, ProcessLookupError, PermissionError):
        return None
