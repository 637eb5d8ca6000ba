"""`disagg experiment`: one workload across request rates against several serving modes on the
same machine, each served by `disagg serve` with its own config, one mode at a time.

For each mode: start the server (a subprocess; free port; Prometheus off), measure the unloaded
latency with a few sequential requests, run the open-loop benchmark at each rate, SIGTERM the
server. Then the report: table and plots of attainment and goodput against rate. Without an
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
    """`disagg serve --config CONFIG --port FREE --ready-file F` as a context manager."""

    def __init__(self, config_path: str, log_path: str, start_timeout_s: float = 300.0, stop_timeout_s: float = 60.0):
        self.config_path = config_path
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.address: str | None = None
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "ServeProcess":
        ready = self.log_path.with_suffix(".ready")
        ready.unlink(missing_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "disagg.cli", "serve", "--config", self.config_path, "--port", str(free_port()), "--ready-file", str(ready)]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            self.address = self._wait_ready(ready)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, ready: Path) -> str:
        deadline = time.monotonic() + self.start_timeout_s
        while not (ready.exists() and ready.read_text().strip()):
            with contextlib.suppress(subprocess.TimeoutExpired):  # a wait that also notices an early exit
                code = self.process.wait(timeout=0.25)
                raise RuntimeError(f"`disagg serve` exited with {code} before it was ready; see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"`disagg serve` was not ready after {self.start_timeout_s:.0f}s; see {self.log_path}")
        return ready.read_text().strip()

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


def run_experiment(exp: ExperimentConfig, requests: list[BenchRequest], workload: dict, log=print) -> dict[str, str]:
    """`requests`: workload_size(exp) of them; returns the report's paths."""
    if len(requests) < workload_size(exp):
        raise ValueError(f"the experiment needs {workload_size(exp)} requests, got {len(requests)}")
    out = Path(exp.out_dir)
    for sub in ("configs", "unloaded", "runs", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    for stale in (out / "runs").glob("*.json"):
        stale.unlink()  # the report reads every run in the folder
    slo = dict(exp.slo) if exp.slo else None
    for mode in exp.modes:
        config_path = _mode_config(exp, mode, out / "configs" / f"{mode}.yaml")
        log(f"[{mode}] starting `disagg serve --config {config_path}`")
        with ServeProcess(str(config_path), str(out / "logs" / f"{mode}.log")) as server:
            unloaded = _unloaded(server.address, requests, exp)
            _save(out / "unloaded" / f"{mode}.json", {**unloaded, "label": mode, "workload": workload})
            s = unloaded["summary"]
            log(f"[{mode}] unloaded: TTFT p50 {s['ttft_ms']['median']:.0f} ms, TPOT p50 {s['tpot_ms']['median']:.1f} ms")
            if slo is None:
                slo = {"ttft_ms": round(exp.slo_factor * s["ttft_ms"]["median"], -1), "tpot_ms": round(exp.slo_factor * s["tpot_ms"]["median"])}
                log(f"SLO set to {exp.slo_factor:g}x the unloaded medians of {mode}: {slo}")
            for i, rate in enumerate(exp.rates):
                load = LoadConfig(request_rate=rate, burstiness=exp.burstiness, num_requests=exp.num_requests, seed=exp.seed + i, max_concurrency=exp.max_concurrency)
                result = run_benchmark(server.address, _phase_requests(exp, requests, i), load, slo)
                _save(out / "runs" / f"{mode}_rate{rate:g}.json", {**result, "label": mode, "workload": workload, "server_config": str(config_path)})
                s = result["summary"]
                log(f"[{mode}] rate {rate:g}: {s['completed']}/{s['num_requests']} ok, attainment {s['slo_attainment_pct']:.1f}%, goodput {s['goodput']:.2f} req/s, TTFT p90 {s['ttft_ms']['p90']:.0f} ms, TPOT p90 {s['tpot_ms']['p90']:.0f} ms")
        log(f"[{mode}] server stopped")
    paths = write_report(load_runs([str(out / "runs")]), str(out), slo)
    _save(out / "experiment.json", {"rates": list(exp.rates), "num_requests": exp.num_requests, "modes": list(exp.modes), "slo": slo, "workload": workload, "burstiness": exp.burstiness, "seed": exp.seed})
    return paths


def _mode_config(exp: ExperimentConfig, mode: str, dest: Path) -> Path:
    """The mode's deploy config, with Prometheus off (fixed ports could clash) and a free gRPC port."""
    if mode not in MODE_CONFIGS:
        raise ValueError(f"mode: {mode!r} is not one of {', '.join(MODE_CONFIGS)}")
    config = yaml.safe_load((Path(exp.config_dir) / MODE_CONFIGS[mode]).read_text()) or {}
    config["metrics_port"] = None
    dest.write_text(f"# {MODE_CONFIGS[mode]} as `disagg experiment` served it\n" + yaml.safe_dump(config, sort_keys=False))
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
    return requests[first + rate_index * exp.num_requests: first + (rate_index + 1) * exp.num_requests]


def _unloaded(address: str, requests: list[BenchRequest], exp: ExperimentConfig) -> dict:
    """Sequential requests: the first warms the server up, the rest measure it unloaded."""
    load = LoadConfig(num_requests=exp.num_unloaded + 1, max_concurrency=1, seed=exp.seed)
    result = run_benchmark(address, _phase_requests(exp, requests, None), load)
    records = [RequestRecord.from_dict(r) for r in result["requests"][1:]]
    result["summary"] = summarize(records, sum(r.e2el for r in records))
    return result


def _save(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")
