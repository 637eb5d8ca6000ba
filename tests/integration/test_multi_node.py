"""The service on a Ray cluster of two nodes (both on this machine, so the test can run here):
the workers listen on and advertise their node's IP, not loopback, since a frontend or peer on
another node could not reach 127.0.0.1; the local Redis does too, behind a password; a loopback
redis_url is refused with a clear error; and greedy output still equals the offline engine's.

The two-node Ray is its own, so it runs in a process of its own (multi_node_service.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("multi_node_service.py")


def test_two_node_cluster_serves_on_node_addresses(tiny_untied_dir):
    run = subprocess.run([sys.executable, str(SCRIPT), tiny_untied_dir], capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    node_ip = result["node_ip"]
    assert node_ip != "127.0.0.1"

    assert result["nodes"]["prefill"] != result["nodes"]["decode"], "each pool on the node with its label"
    for role, addresses in result["advertised"].items():
        assert addresses and all(a.rsplit(":", 1)[0] == node_ip for a in addresses), (role, addresses)
    assert result["redis"] == {"host": node_ip, "has_password": True}
    assert "redis_url" in (result["loopback_redis_error"] or ""), result["loopback_redis_error"]
    assert result["served"] == result["offline"]
