"""What `disagg serve` records of its deployment (disagg.cluster.deployment_state): owner-only,
read back whole, gone once forgotten; a pid counts as the recorded process only while its
command line still names what it was started with."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from disagg.cluster.deployment_state import DeploymentState, forget_state, load_state, process_alive, state_path


def test_a_record_is_owner_only_and_read_back_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("DISAGG_STATE_DIR", str(tmp_path / "state"))
    assert load_state() is None
    state = DeploymentState("ab12cd", "127.0.0.1:6379", "redis://:pw@127.0.0.1:1234/0", 42, ray_temp_dir="/tmp/x")
    state.save()
    assert state_path().stat().st_mode & 0o077 == 0, "the Redis URL holds its password"
    assert load_state() == state
    forget_state()
    assert load_state() is None


def test_a_damaged_record_is_no_record(tmp_path):
    (tmp_path / "deployment.json").write_text("{not json")
    assert load_state(tmp_path) is None


def test_a_pid_is_ours_only_while_its_command_line_names_it(tmp_path):
    marker = str(tmp_path / "marker")
    proc = subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(30)", marker])
    try:
        deadline = time.monotonic() + 10
        while not process_alive(proc.pid, marker) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the child has exec'd
        assert process_alive(proc.pid, marker) and process_alive(proc.pid)
        assert not process_alive(proc.pid, str(tmp_path / "another"))
    finally:
        proc.kill()
        proc.wait()
    assert not process_alive(proc.pid, marker) and not process_alive(None)
    assert process_alive(os.getpid())
