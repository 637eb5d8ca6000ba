"""`disagg serve` as an operator runs it, for the benchmarks that need a whole deployment.

The default deployment (its own Ray and redis-server, gRPC on 127.0.0.1) in its own session, so
that every process it starts can be found (to kill one, or read its RSS) and stopped together.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

from disagg.bench.experiment import free_port
from disagg.client import DisaggClient

WORKER_KINDS = ("PrefillActor", "DecodeActor", "InstanceActor")


class Deployment:
    """`disagg serve` in its own session; its processes found by their session id."""

    def __init__(self, workdir: Path, base_config: str | None = None, **config_overrides):
        """`base_config`: a serving config file to start from (None: the default deployment);
        `config_overrides`: the benchmark's own settings, laid over it."""
        ports = {"port": free_port(), "metrics_port": free_port(), "http_port": 0}
        config = merged(read_config(base_config), {**ports, **config_overrides})
        (workdir / "serving-config.yaml").write_text(yaml.safe_dump(config))
        self.metrics_url = f"http://127.0.0.1:{config['metrics_port']}/metrics"
        self.ready, self.log = workdir / "ready", workdir / "serve.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "disagg.cli", "serve", "--config", str(workdir / "serving-config.yaml"),
                 "--ready-file", str(self.ready)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 300
        while not self.ready.exists() or not self.ready.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit(f"disagg serve did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)
        lines = self.ready.read_text().split()
        self.address = lines[0]
        self.frontend_addresses = lines[1].split(",") if len(lines) > 1 else [self.address]

    def processes(self) -> dict[int, str]:
        """pid -> a short name, every live process of the deployment: its session, and its
        children that start sessions of their own (redis-server)."""
        found = {}
        try:
            children = {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.Error:
            children = set()
        for p in psutil.process_iter(["pid", "cmdline", "name"]):
            try:
                ours = os.getsid(p.pid) == self.proc.pid or p.pid in children
                if ours and p.status() != psutil.STATUS_ZOMBIE:
                    found[p.pid] = " ".join(p.info["cmdline"] or [p.info["name"]])[:80]
            except (psutil.Error, OSError):
                continue
        return found

    def redis(self) -> dict[int, str]:
        return {pid: name for pid, name in self.processes().items() if "redis-server" in name}

    def frontend_replicas(self) -> dict[int, str]:
        """The frontends Ray runs (frontends 1..N-1; frontend 0 is `disagg serve` itself)."""
        return {pid: name for pid, name in self.processes().items() if "FrontendReplica" in name}

    def workers(self) -> dict[int, str]:
        return {pid: name for pid, name in self.processes().items() if any(k in name for k in WORKER_KINDS)}

    def rss_mb(self) -> dict[str, float]:
        rss = {}
        for pid, name in self.processes().items():
            try:
                rss[f"{pid} {name}"] = psutil.Process(pid).memory_info().rss / 2**20
            except psutil.Error:
                continue
        return rss

    def migrations(self) -> float:
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        lines = [line for line in text.splitlines() if line.startswith("disagg:request_migrations_total{")]
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def add_config_argument(parser) -> None:
    """`--config`: what a benchmark's deployment starts from, the same way in every script."""
    parser.add_argument(
        "--config",
        help="a serving config to start from (default: the default deployment); the benchmark's own settings go over it",
    )


def read_config(path: str | None) -> dict:
    return (yaml.safe_load(Path(path).read_text()) or {}) if path else {}


def merged(base: dict, over: dict) -> dict:
    """`over` laid on `base`, section by section (a nested mapping is merged, anything else replaced)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def listed(client: DisaggClient) -> int:
    return sum(len(pool.instances) for pool in client.cluster_status().pools)


def leaked_blocks(client: DisaggClient, timeout_s: float = 30) -> int:
    """KV blocks still allocated on every instance once nothing runs (waits for idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = sum(
            i.num_total_blocks - i.num_free_blocks for pool in client.cluster_status().pools for i in pool.instances
        )
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.5)
