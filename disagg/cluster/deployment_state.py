"""What `disagg serve` records of the deployment it started on this machine, so that a second
`disagg serve` attaches to it and `disagg stop` ends it, whether or not the first process still
lives: the Ray to join, the Redis, and the processes it started that are no children of its session's
end (the Ray head's temp dir; the address of the redis-server it started, which that
process's title names however often it was restarted, under a new pid each time). One JSON file, owner-only (the Redis URL holds
its password), in $DISAGG_STATE_DIR.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from disagg.config import env

STATE_FILE = "deployment.json"


@dataclass(frozen=True)
class DeploymentState:
    deployment_id: str
    ray_address: str  # the GCS's HOST:PORT
    redis_url: str
    serve_pid: int  # the `disagg serve` that started it
    ray_temp_dir: str | None = None  # a Ray head it started (disagg.cluster.local_ray), else None
    redis_address: str | None = None  # HOST:PORT of a redis-server it started, else None

    def save(self) -> None:
        path = state_path()
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f)


def state_path(state_dir: Path | None = None) -> Path:
    """The record in `state_dir` (None: $DISAGG_STATE_DIR)."""
    return (state_dir or Path(env("DISAGG_STATE_DIR")).expanduser()) / STATE_FILE


def load_state(state_dir: Path | None = None) -> DeploymentState | None:
    """The deployment recorded in `state_dir` (None: $DISAGG_STATE_DIR), or None."""
    try:
        return DeploymentState(**json.loads(state_path(state_dir).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def forget_state() -> None:
    with contextlib.suppress(FileNotFoundError):
        state_path().unlink()


def process_alive(pid: int | None, naming: str | None = None) -> bool:
    """Whether process `pid` runs (and, given `naming`, its command line names it: a pid the
    kernel gave to another process since is not ours)."""
    if pid is None:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return naming is None or naming.encode() in cmdline


def redis_processes(address: str | None) -> list[int]:
    """The pids of redis-server on `address` (HOST:PORT): redis-server titles itself
    `redis-server HOST:PORT`."""
    if address is None:
        return []
    title = f"redis-server {address}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and title in _cmdline(entry):
            found.append(int(entry.name))
    return found


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""
