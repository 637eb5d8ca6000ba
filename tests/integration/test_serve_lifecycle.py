"""A deployment outlives the `disagg serve` that started it (issue 52): real commands as
subprocesses, the server's own Ray head (`ray start`) and redis-server, two frontends.

- `disagg serve` killed outright (SIGKILL) mid-stream: every frontend, frontend 0 included, is a
  detached actor: the streams in flight on both complete, and both answer on;
- `disagg serve` run again (as an operator would) attaches to the running deployment within
  10 s, starting nothing;
- `disagg stop` ends the deployment: no process of its Ray head, no redis-server, no record left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disagg.bench.launcher import free_port
from disagg.client import DisaggClient, generate_request
from disagg.cluster.deployment_state import load_state, redis_processes
from disagg.cluster.local_ray import LocalRayHead

BIN = Path(sys.executable).parent / "disagg"
START_TIMEOUT_S = 240
ATTACH_TIMEOUT_S = 10
STREAM_TOKENS = 64


def _serve(workdir: Path, ready: Path, args: list[str], log_name: str) -> subprocess.Popen:
    with open(workdir / log_name, "w") as log:
        return subprocess.Popen(
            [str(BIN), "serve", "--ready-file", str(ready), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "DISAGG_STATE_DIR": str(workdir / "state")},
        )


def _wait_ready(proc: subprocess.Popen, ready: Path, timeout_s: float, log: Path) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while not ready.exists() or not ready.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"disagg serve not ready in {timeout_s:.0f} s: {log.read_text()[-3000:]}")
        time.sleep(0.2)
    lines = ready.read_text().split()
    return lines[1].split(",") if len(lines) > 1 else lines


def _request(max_tokens: int):
    return generate_request("What is the capital of France?", max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


def test_serve_attaches_outlives_a_sigkill_and_stop_ends_it(tmp_path):
    args = ["--port", str(free_port()), "--http-port", "0", "--frontends", "2", "--calibration-s", "0",
            "--metrics-port", "null"]  # fmt: skip
    first = _serve(tmp_path, tmp_path / "ready-1", args, "serve-1.log")
    try:
        frontends = _wait_ready(first, tmp_path / "ready-1", START_TIMEOUT_S, tmp_path / "serve-1.log")
        state = load_state(tmp_path / "state")
        assert len(frontends) == 2 and state is not None and state.ray_temp_dir
        assert len(redis_processes(state.redis_address)) == 1, "the check below can fail"

        clients = [DisaggClient(address) for address in frontends]
        streams = [client.stream(_request(STREAM_TOKENS), timeout=120) for client in clients]
        received = [list(next(stream).token_ids) for stream in streams]  # both in flight
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        for tokens, stream in zip(received, streams):
            for message in stream:
                tokens += message.token_ids
        assert [len(tokens) for tokens in received] == [STREAM_TOKENS] * 2, "a stream ended with disagg serve"
        for client in clients:
            assert len(client.generate(_request(4), timeout=60)[0]) == 4
            client.close()

        started = time.monotonic()
        second = _serve(tmp_path, tmp_path / "ready-2", args, "serve-2.log")
        attached = _wait_ready(second, tmp_path / "ready-2", ATTACH_TIMEOUT_S, tmp_path / "serve-2.log")
        attach_s = time.monotonic() - started
        assert "attached to it, not starting another" in (tmp_path / "serve-2.log").read_text()
        assert sorted(attached) == sorted(frontends), "the same deployment's frontends"
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=30) == 0  # it detaches; the deployment runs on
        print(f"attached in {attach_s:.1f} s")
    finally:
        if first.poll() is None:
            first.kill()
        stopped = subprocess.run(
            [str(BIN), "stop"], capture_output=True, text=True, timeout=180,
            env={**os.environ, "DISAGG_STATE_DIR": str(tmp_path / "state")},
        )  # fmt: skip
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not LocalRayHead(state.ray_address, state.ray_temp_dir).processes(), "a Ray process of it runs on"
    assert state.redis_address and not redis_processes(state.redis_address), "its redis-server runs on"
    assert load_state(tmp_path / "state") is None
