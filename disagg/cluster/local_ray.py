"""A Ray head of a deployment's own on this machine, started by `ray start --head`, whose daemons
are no process's children (unlike `ray.init()`'s, which die with their driver), so that it
outlives `disagg serve` (SIGKILL included) with the detached actors on it; they stay in the
server's session, as `ray.init()`'s did (a terminal's Ctrl-C ends the deployment either way).
Given a Redis, its GCS keeps its tables there (Ray's GCS fault tolerance: `RAY_REDIS_ADDRESS`,
`--redis-password`), so that a GCS that restarts finds them again; that Redis must then be as
durable as the GCS (one that dies takes the GCS with it).

Stopped by `stop()`: every process whose command line names this head's temp dir (its GCS,
raylet, workers), never another Ray of the machine (`ray stop` would end every one).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from disagg.config import child_env
from disagg.errors import UnavailableError

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
RAYLESS_GRACE_S = 1.0  # for the head's processes once its raylet is gone


@dataclass(frozen=True)
class LocalRayHead:
    address: str  # the GCS's HOST:PORT, what ray.init(address=...) takes
    temp_dir: str  # in the command line of each of its processes

    @classmethod
    def start(cls, port: int, num_cpus: int, redis_url: str | None, system_config: dict) -> "LocalRayHead":
        """`redis_url`: the deployment's Redis, where the GCS keeps its tables (None: in memory)."""
        temp_dir = tempfile.mkdtemp(prefix="disagg-ray-")
        command = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}",
            f"--num-cpus={num_cpus}", "--include-dashboard=false", "--disable-usage-stats",
            f"--temp-dir={temp_dir}", f"--system-config={json.dumps(system_config)}", "--node-ip-address=127.0.0.1",
            # Free ports, not Ray's fixed defaults (8265, 10001): another Ray of the machine may hold those.
            f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}",
            # No autoscaler on a machine of its own: its monitor is one more Python process to
            # start (about 5 s of a 2-core host's `ray start`), and it scales nothing here.
            "--no-monitor",
        ]  # fmt: skip
        use_token_auth()
        env = child_env()
        if redis_url is not None:
            parsed = urlparse(redis_url)
            env = child_env(RAY_REDIS_ADDRESS=f"{parsed.hostname}:{parsed.port}")
            if parsed.password:  # (Ray takes it on the command line only: its gcs_server shows it to `ps` anyway)
                command += ["--redis-username=default", f"--redis-password={parsed.password}"]
        log_path = Path(temp_dir) / "ray-start.log"
        with open(log_path, "w") as log:  # a file, not a pipe: the daemons it leaves would hold a pipe open
            done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=START_TIMEOUT_S,
                                  check=False)  # fmt: skip
        head = cls(f"127.0.0.1:{port}", temp_dir)
        if done.returncode != 0:
            tail = log_path.read_text(errors="replace")[-2000:]
            head.stop()
            raise UnavailableError(f"`ray start --head` failed ({done.returncode}): {tail}")
        return head

    def processes(self) -> list[int]:
        """The pids of this head's processes: those whose command line names its temp dir (its
        GCS, raylet, monitors) and every descendant of theirs (workers, agents, which retitle
        themselves `ray::...`)."""
        parents = _parents()
        ours = {pid for pid in parents if pid != os.getpid() and self._names_it(_cmdline(pid))}
        grew = True
        while grew:
            below = {pid for pid, parent in parents.items() if parent in ours} - ours
            ours |= below
            grew = bool(below)
        return sorted(ours)

    def _names_it(self, cmdline: bytes) -> bool:
        """Its temp dir, or its GCS's address (Ray's client server names only that)."""
        port = self.address.rpartition(":")[2]
        return self.temp_dir.encode() in cmdline or (b"--address=" in cmdline and f":{port}\0".encode() in cmdline)

    def stop(self) -> None:
        """The raylet first, with its workers (SIGTERM: it ends them, as Ray's own shutdown does);
        then the rest (the GCS, agents), which hold nothing to save: a GCS in memory left alone
        with SIGTERM takes more than STOP_TIMEOUT_S, so they get SIGKILL after a short grace."""
        pids = self.processes()
        raylets = [pid for pid in pids if _cmdline(pid).split(b"\0")[0].endswith(b"/raylet")]
        _end(raylets, STOP_TIMEOUT_S)
        _end([pid for pid in pids if pid not in raylets], RAYLESS_GRACE_S)
        with contextlib.suppress(OSError):
            subprocess.run(["rm", "-rf", self.temp_dir], check=False, timeout=30)


def _end(pids: list[int], grace_s: float) -> None:
    """SIGTERM to each of `pids`, SIGKILL to those left after `grace_s`."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, STOP_TIMEOUT_S)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while (pids := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (/proc/PID/stat's fourth field)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                found[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    return found


def _alive(pid: int) -> bool:
    """Runs (a zombie, whose parent has not reaped it yet, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def use_token_auth() -> None:
    """Ray's token authentication, for this process and those it starts: the head's GCS asks every
    client for the token in ~/.ray/auth_token (`ray start` makes one if there is none), and a
    driver joining it sends it only in this mode (ray.init() of a local Ray does it by itself).
    Ray reads the mode once into its config: set it there too, as ray.init() does."""
    from ray._private.authentication.authentication_token_setup import _enable_token_auth

    _enable_token_auth()
