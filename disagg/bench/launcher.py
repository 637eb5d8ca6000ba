"""The one deployment launcher of the benchmarks: a serving config brought up and torn down.

By default `disagg serve` as an operator runs it, in a process session of its own (its own Ray
and redis-server unless the config names others, gRPC on 127.0.0.1 at a free port), so that
every process it starts can be found (to kill one, or read its RSS) and stopped together. With
`in_process=True` the same config runs as a `Server` in this process instead, for a benchmark
that reaches into its launcher and actors.

The config is the benchmark's settings laid over a base config file (`--config`, the same way
in every script), over the defaults, as `disagg serve --config BASE --SETTING VALUE` would lay
them (disagg.config.merge_settings); its ports (free ones) go on the command line, so that the
config file it writes holds only what the benchmark chose.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from disagg.config import ServingConfig, child_env, merge_settings, read_yaml_settings

WORKER_KINDS = ("WorkerActor",)  # every worker process is one (disagg.worker.actor), whichever its role
READY_POLL_S = 0.25


class Deployment:
    """A serving config brought up (`with Deployment(...) as dep:`, or `start()` then
    `wait_ready()` for several at once) and torn down (`stop()`; leaving the `with` also removes
    a work directory it made itself)."""

    def __init__(
        self,
        settings: dict | None = None,
        *,
        base: str | None = None,
        workdir: str | Path | None = None,
        name: str = "serve",
        log: str | Path | None = None,
        http: bool = False,
        in_process: bool = False,
        code: str | Path | None = None,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 90.0,
    ):
        """`settings`: the benchmark's own, over `base` (a serving config file; None: the
        defaults). `workdir`: where its config and log go (None: a temporary directory, removed
        on exit). `name`: of its config and log files (`log`: the log elsewhere). `http`: serve the OpenAI-compatible API
        too, on a free port. `code`: a checkout of this repository whose `disagg` the server runs
        (another revision's; it runs from there, with that on its PYTHONPATH)."""
        own = settings or {}
        free = {"port": free_port(), "metrics_port": free_port(), "http_port": free_port() if http else 0}
        self.ports = {name: own.get(name, port) for name, port in free.items()}  # never a base config's
        self.settings = merge_settings(read_config(base), {k: v for k, v in own.items() if k not in self.ports})
        self.config = merge_settings(self.settings, self.ports)
        self.in_process = in_process
        self.code = Path(code).resolve() if code else None
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"disagg-{name}-")).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / f"{name}.yaml"
        self.log = Path(log).resolve() if log else self.workdir / f"{name}.log"
        self._ready = self.workdir / f"{name}.ready"
        self.address: str | None = None
        self.frontend_addresses: list[str] = []
        self.process: subprocess.Popen | None = None  # the `disagg serve` running now
        self.session: int | None = None  # the first one's pid: Ray's processes stay in its session
        self._command: list[str] = []
        self._env: dict[str, str] = {}
        self.reattached = False  # the first `disagg serve` was killed and another attached (kill_serve)
        self.server = None  # in process: the disagg.server.Server
        self._started_at = 0.0

    # ---- where it serves ---------------------------------------------------------------------------
    @property
    def http_url(self) -> str | None:
        port = self.config.get("http_port") or 0
        return f"http://127.0.0.1:{port}" if port else None

    @property
    def metrics_url(self) -> str | None:
        port = self.config.get("metrics_port")
        return f"http://127.0.0.1:{port}/metrics" if port else None

    # ---- up and down -------------------------------------------------------------------------------
    def __enter__(self) -> Deployment:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Begin bringing it up (`wait_ready` waits for it)."""
        self.config_path.write_text(yaml.safe_dump(self.settings, sort_keys=False))
        self._started_at = time.monotonic()
        if self.in_process:
            self._start_in_process()
            return
        self._ready.unlink(missing_ok=True)
        command = [sys.executable, "-m", "disagg.cli", "serve", "--config", str(self.config_path)]
        for name, value in self.ports.items():  # the benchmark's own where it set one, else a free one
            command += [f"--{name.replace('_', '-')}", "null" if value is None else str(value)]
        command += ["--ready-file", str(self._ready)]
        # Its own record of the deployment (disagg.cluster.deployment_state): two benchmarks'
        # servers on one machine must not attach to each other's.
        env = child_env(
            DISAGG_STATE_DIR=str(self.workdir / "state"), **({"PYTHONPATH": str(self.code)} if self.code else {})
        )
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._command, self._env = command, env
        self._launch("w")
        self.session = self.process.pid

    def _launch(self, mode: str) -> None:
        with open(self.log, mode) as log:
            self.process = subprocess.Popen(
                self._command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.code,
                env=self._env,
            )  # fmt: skip

    def kill_serve(self) -> int:
        """SIGKILL the `disagg serve` process alone (its deployment serves on); its pid."""
        pid = self.process.pid
        self.process.kill()
        self.process.wait()
        return pid

    def attach(self) -> str:
        """`disagg serve` again, as an operator would after it died: it attaches to the running
        deployment. Its gRPC HOST:PORT once it has (the frontends' addresses stay those known:
        their ports are fixed, and one that restarts now would be missing from its list)."""
        known = self.address, self.frontend_addresses
        self._ready.unlink(missing_ok=True)
        self._started_at = time.monotonic()
        self._launch("a")
        self.reattached = True
        self.wait_ready()
        self.address, self.frontend_addresses = known
        return self.address

    def _start_in_process(self) -> None:
        from disagg.server import Server

        self.server = Server(ServingConfig.from_dict(self.config))
        self.server.__enter__()
        self.address = self.server.address
        self.frontend_addresses = [self.address]

    def wait_ready(self) -> str:
        """Its gRPC HOST:PORT once it serves; a failed start raises with its log's end."""
        if self.in_process:
            return self.address
        while not (self._ready.exists() and self._ready.read_text().strip()):
            with contextlib.suppress(subprocess.TimeoutExpired):  # a wait that also notices an early exit
                code = self.process.wait(timeout=READY_POLL_S)
                raise RuntimeError(f"`disagg serve` exited with {code} before it was ready:\n{self.log_tail()}")
            if time.monotonic() > self._started_at + self.start_timeout_s:
                self.stop()
                raise TimeoutError(f"`disagg serve` not ready after {self.start_timeout_s:.0f} s:\n{self.log_tail()}")
        lines = self._ready.read_text().split()
        self._ready.unlink()
        self.address = lines[0]
        self.frontend_addresses = lines[1].split(",") if len(lines) > 1 else [self.address]
        return self.address

    def stop(self) -> int | None:
        """SIGTERM (its own shutdown stops what it started), SIGKILL to its session if it hangs."""
        if self.server is not None:
            server, self.server = self.server, None
            server.__exit__(None, None, None)
            return 0
        if self.process is None:
            return None
        code = self.process.returncode if self.process.poll() is not None else self._terminate()
        if self.reattached:  # SIGTERM only detaches an attached `disagg serve`: `disagg stop` ends it
            stop = [sys.executable, "-m", "disagg.cli", "stop"]
            subprocess.run(stop, env=self._env, cwd=self.code, timeout=self.stop_timeout_s + 120, check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            self.reattached = False
        return code

    def _terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
            self._stop_leftovers()
            return code

    def _stop_leftovers(self) -> None:
        """What a killed `disagg serve` started outside its session (its redis-server, its Ray head)."""
        from disagg.cluster.deployment_state import load_state
        from disagg.deployments import stop_leftovers

        state = load_state(self.workdir / "state")
        if state is not None:
            stop_leftovers(state)

    def close(self) -> None:
        """`stop`, and remove the work directory where it made one itself."""
        self.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"

    # ---- what runs in it ---------------------------------------------------------------------------
    def processes(self) -> dict[int, str]:
        """pid -> a short name, every live process of the deployment: the first `disagg serve`'s
        session, the one running now, and its redis-server (a session of its own, and no
        process's child once the `disagg serve` that started it was killed)."""
        import psutil

        if self.process is None:
            raise RuntimeError("an in-process deployment has no processes of its own")
        try:
            children = {c.pid for c in psutil.Process(self.process.pid).children(recursive=True)}
        except psutil.Error:
            children = set()
        children |= {self.process.pid, *self._redis_pids()}
        found = {}
        for p in psutil.process_iter(["pid", "cmdline", "name"]):
            try:
                ours = os.getsid(p.pid) == self.session or p.pid in children
                if ours and p.status() != psutil.STATUS_ZOMBIE:
                    found[p.pid] = " ".join(p.info["cmdline"] or [p.info["name"]])[:80]
            except (psutil.Error, OSError):
                continue
        return found

    def _redis_pids(self) -> list[int]:
        from disagg.cluster.deployment_state import load_state, redis_processes

        state = load_state(self.workdir / "state")
        return redis_processes(state.redis_address) if state is not None else []

    def workers(self) -> dict[int, str]:
        return {pid: name for pid, name in self.processes().items() if any(k in name for k in WORKER_KINDS)}

    def redis(self) -> dict[int, str]:
        return {pid: name for pid, name in self.processes().items() if "redis-server" in name}

    def controller(self) -> dict[int, str]:
        """The deployment's controller (disagg.controller), which Ray restarts when it dies."""
        return {pid: name for pid, name in self.processes().items() if "ray::Controller" in name}

    def frontend_replicas(self) -> dict[int, str]:
        """The frontends, every one a detached actor that Ray restarts (`disagg serve` runs none
        itself)."""
        return {pid: name for pid, name in self.processes().items() if "FrontendReplica" in name}

    def rss_mb(self) -> dict[str, float]:
        """`pid name` -> resident MiB of every process of the deployment."""
        import psutil

        rss = {}
        for pid, name in self.processes().items():
            with contextlib.suppress(psutil.Error):
                rss[f"{pid} {name}"] = psutil.Process(pid).memory_info().rss / 2**20
        return rss

    def metric(self, prefix: str) -> float:
        """The sum of every Prometheus sample whose line starts with `prefix`
        (e.g. 'disagg:request_migrations_total{')."""
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_config(path: str | None) -> dict:
    """A serving config file's settings ({} for None)."""
    return read_yaml_settings(path) if path else {}


def add_config_argument(parser, default: str | None = None) -> None:
    """`--config`: what a benchmark's deployment starts from, the same way in every script."""
    parser.add_argument(
        "--config",
        default=default,
        help="a serving config to start from (default: the default deployment); the benchmark's own settings go over it",
    )


# ---- the cluster as its status says it ------------------------------------------------------------
def listed(client) -> int:
    """Instances the deployment lists (a DisaggClient's ClusterStatus)."""
    return sum(len(pool.instances) for pool in client.cluster_status().pools)


def held_blocks(client) -> dict[str, int]:
    """KV blocks allocated now, per pool."""
    return {
        pool.role: sum(i.num_total_blocks - i.num_free_blocks for i in pool.instances)
        for pool in client.cluster_status().pools
    }


def leaked_blocks(client, timeout_s: float = 30) -> int:
    """KV blocks still allocated on every instance once nothing runs (waits for idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = sum(held_blocks(client).values())
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.5)
