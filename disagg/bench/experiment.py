"""`disagg experiment`: one workload across request rates against several serving modes on the
same machine and cores, each served by `disagg serve` (a subprocess; free port; Prometheus off)
with its own config.

Every server first answers a few sequential requests (its unloaded latency), then the open-loop
benchmark runs at each rate. By default all the servers are up at once (idle workers sleep and
cost nothing) and the modes take turns at each rate, in rotated order: on a shared, noisy
machine, background load then falls on every mode alike. `interleave=False` runs one server at
a time instead (start, every rate, SIGTERM, next mode) for machines short of memory. Without an
SLO, one is set at `slo_factor` times the first mode's unloaded median TTFT and TPOT.

Output directory:
  configs/<mode>.yaml         the config each server ran
  unloaded/<mode>.json        the sequential warm-up requests (unloaded latency)
  runs/<mode>_rate<r>.json    one `disagg bench` result per (mode, rate)
  logs/<mode>.log             the server's output
  table.md, summary.csv, *.png, experiment.json
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from disagg.bench.metrics import RequestRecord, summarize
from disagg.bench.open_loop import LoadConfig, run_benchmark
from disagg.bench.report import load_runs, write_report
from disagg.bench.workloads import BenchRequest

MODE_CONFIGS = {
    "disaggregated": "disaggregated.yaml",  # 1 prefill + 1 decode worker, 1 core each
    "colocated-chunked": "colocated.yaml",  # 1 worker, 2 cores, chunked prefill (Sarathi)
    "colocated-prefill-first": "colocated-prefill-first.yaml",  # 1 worker, 2 cores, whole prompts first
}


class ServeProcess:
    """`disagg serve --config CONFIG --port FREE --ready-file F` as a context manager; its HTTP API
    on `http_port` (0: none)."""

    def __init__(
        self,
        config_path: str,
        log_path: str,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 60.0,
        http_port: int = 0,
    ):
        self.config_path = config_path
        self.http_port = http_port
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.address: str | None = None
        self.process: subprocess.Popen | None = None
        self._ready = self.log_path.with_suffix(".ready")
        self._started_at = 0.0

    def __enter__(self) -> "ServeProcess":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def start(self) -> None:
        self._ready.unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "disagg.cli",
            "serve",
            "--config",
            self.config_path,
            "--port",
            str(free_port()),
            "--http-port",  # servers side by side must not share port 8000: 0 unless one is given
            str(self.http_port),
            "--ready-file",
            str(self._ready),
        ]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self._started_at = time.monotonic()

    def wait_ready(self) -> str:
        """The server's HOST:PORT once it has written its ready file."""
        while not (self._ready.exists() and self._ready.read_text().strip()):
            with contextlib.suppress(subprocess.TimeoutExpired):  # a wait that also notices an early exit
                code = self.process.wait(timeout=0.25)
                raise RuntimeError(f"`disagg serve` exited with {code} before it was ready; see {self.log_path}")
            if time.monotonic() > self._started_at + self.start_timeout_s:
                raise TimeoutError(
                    f"`disagg serve` was not ready after {self.start_timeout_s:.0f}s; see {self.log_path}"
                )
        self.address = self._ready.read_text().strip()
        self._ready.unlink()
        return self.address

    def stop(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def __exit__(self, *exc) -> None:
        self.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ExperimentConfig:
    rates: tuple[float, ...]
    num_requests: int
    out_dir: str
    modes: tuple[str, ...] = tuple(MODE_CONFIGS)
    config_dir: str = "deploy/configs"
    slo: dict | None = None  # None: slo_factor x the first mode's unloaded medians
    slo_factor: float = 4.0
    num_unloaded: int = 4
    burstiness: float = 1.0
    seed: int = 0
    max_concurrency: int | None = None
    interleave: bool = True  # all servers up at once, modes alternating at each rate
    # mode -> config file, for modes that are not MODE_CONFIGS' (e.g. a plan's candidates)
    config_files: dict[str, str] | None = None


def run_experiment(exp: ExperimentConfig, requests: list[BenchRequest], workload: dict, log=print) -> dict[str, str]:
    """`requests`: workload_size(exp) of them; returns the report's paths."""
    if len(requests) < workload_size(exp):
        raise ValueError(f"the experiment needs {workload_size(exp)} requests, got {len(requests)}")
    out = Path(exp.out_dir)
    for sub in ("configs", "unloaded", "runs", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    for stale in (out / "runs").glob("*.json"):
        stale.unlink()  # the report reads every run in the folder
    phases = _Phases(exp, requests, workload, out, log)
    configs = {mode: _mode_config(exp, mode, out / "configs" / f"{mode}.yaml") for mode in exp.modes}
    if exp.interleave:
        with contextlib.ExitStack() as stack:
            servers = {
                mode: ServeProcess(str(config), str(out / "logs" / f"{mode}.log")) for mode, config in configs.items()
            }
            for mode, server in servers.items():
                log(f"[{mode}] starting `disagg serve --config {configs[mode]}`")
                stack.callback(server.stop)
                server.start()
            for server in servers.values():
                server.wait_ready()
            for mode, server in servers.items():
                phases.unloaded(mode, server.address)
            for i, rate in enumerate(exp.rates):
                for mode in (
                    exp.modes[i % len(exp.modes) :] + exp.modes[: i % len(exp.modes)]
                ):  # rotated: no mode always goes first
                    phases.at_rate(mode, servers[mode].address, i, rate, configs[mode])
    else:
        for mode, config in configs.items():
            log(f"[{mode}] starting `disagg serve --config {config}`")
            with ServeProcess(str(config), str(out / "logs" / f"{mode}.log")) as server:
                phases.unloaded(mode, server.address)
                for i, rate in enumerate(exp.rates):
                    phases.at_rate(mode, server.address, i, rate, config)
            log(f"[{mode}] server stopped")
    paths = write_report(load_runs([str(out / "runs")]), str(out), phases.slo)
    _save(
        out / "experiment.json",
        {
            "rates": list(exp.rates),
            "num_requests": exp.num_requests,
            "modes": list(exp.modes),
            "interleave": exp.interleave,
            "slo": phases.slo,
            "workload": workload,
            "burstiness": exp.burstiness,
            "seed": exp.seed,
        },
    )
    return paths


class _Phases:
    """The experiment's two kinds of measurement, saving each result as it comes."""

    def __init__(self, exp: ExperimentConfig, requests: list[BenchRequest], workload: dict, out: Path, log):
        self.exp, self.requests, self.workload, self.out, self.log = exp, requests, workload, out, log
        self.slo = dict(exp.slo) if exp.slo else None

    def unloaded(self, mode: str, address: str) -> None:
        """Sequential requests: the first warms the server up, the rest measure it unloaded."""
        exp = self.exp
        result = run_benchmark(
            address,
            _phase_requests(exp, self.requests, None),
            LoadConfig(num_requests=exp.num_unloaded + 1, max_concurrency=1, seed=exp.seed),
        )
        records = [RequestRecord.from_dict(r) for r in result["requests"][1:]]
        result["summary"] = s = summarize(records, sum(r.e2el for r in records))
        _save(self.out / "unloaded" / f"{mode}.json", {**result, "label": mode, "workload": self.workload})
        self.log(
            f"[{mode}] unloaded: TTFT p50 {s['ttft_ms']['median']:.0f} ms, TPOT p50 {s['tpot_ms']['median']:.1f} ms"
        )
        if self.slo is None:
            self.slo = {
                "ttft_ms": round(exp.slo_factor * s["ttft_ms"]["median"], -1),
                "tpot_ms": round(exp.slo_factor * s["tpot_ms"]["median"]),
            }
            self.log(f"SLO set to {exp.slo_factor:g}x the unloaded medians of {mode}: {self.slo}")

    def at_rate(self, mode: str, address: str, rate_index: int, rate: float, config: Path) -> None:
        exp = self.exp
        load = LoadConfig(
            request_rate=rate,
            burstiness=exp.burstiness,
            num_requests=exp.num_requests,
            seed=exp.seed + rate_index,
            max_concurrency=exp.max_concurrency,
        )
        result = run_benchmark(address, _phase_requests(exp, self.requests, rate_index), load, self.slo)
        _save(
            self.out / "runs" / f"{mode}_rate{rate:g}.json",
            {**result, "label": mode, "workload": self.workload, "server_config": str(config)},
        )
        s = result["summary"]
        self.log(
            f"[{mode}] rate {rate:g}: {s['completed']}/{s['num_requests']} ok, attainment {s['slo_attainment_pct']:.1f}%, goodput {s['goodput']:.2f} req/s, TTFT p90 {s['ttft_ms']['p90']:.0f} ms, TPOT p90 {s['tpot_ms']['p90']:.0f} ms"
        )


def _mode_config(exp: ExperimentConfig, mode: str, dest: Path) -> Path:
    files = exp.config_files or {}
    if mode not in MODE_CONFIGS and mode not in files:
        raise ValueError(f"mode: {mode!r} is not one of {', '.join([*MODE_CONFIGS, *files])}")
    source = Path(files[mode]) if mode in files else Path(exp.config_dir) / MODE_CONFIGS[mode]
    return config_without_fixed_ports(source, dest, exp.slo)


def config_without_fixed_ports(source: Path, dest: Path, slo: dict | None = None) -> Path:
    """A copy of a serving config with Prometheus off (a fixed port could be taken); the gRPC
    port is given on the command line. With `slo`, the config's SLO is the experiment's: its
    goodput placement admits by the targets the experiment measures against (and a simulator
    replaying the config by the same ones)."""
    config = yaml.safe_load(Path(source).read_text()) or {}
    config["metrics_port"] = None
    changed = "metrics_port: null"
    if slo:
        config["slo"] = {key: slo[key] for key in ("ttft_ms", "tpot_ms") if key in slo}
        changed += f", slo: {config['slo']}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(f"# {source} with {changed}\n" + yaml.safe_dump(config, sort_keys=False))
    return dest


def workload_size(exp: ExperimentConfig) -> int:
    """Requests the experiment needs: every phase gets its own prompts, because the servers
    cache prefixes and a repeated prompt would skip its prefill."""
    return exp.num_unloaded + 1 + exp.num_requests * len(exp.rates)


def _phase_requests(exp: ExperimentConfig, requests: list[BenchRequest], rate_index: int | None) -> list[BenchRequest]:
    """The unloaded phase's requests (None) or those of the rate_index-th rate; the same for every mode."""
    first = exp.num_unloaded + 1
    if rate_index is None:
        return requests[:first]
    return requests[first + rate_index * exp.num_requests : first + (rate_index + 1) * exp.num_requests]


def _save(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")
