"""`disagg experiment`: one workload across request rates against several serving modes on the
same machine and cores, each served by `disagg serve` with its own config (disagg.bench.launcher)
and loaded by the open loop (disagg.bench.load_client).

Every server first answers a few sequential requests (its unloaded latency), then the open-loop
benchmark runs at each rate. By default all the servers are up at once (idle workers sleep and
cost nothing) and the modes take turns at each rate, in rotated order: on a shared, noisy
machine, background load then falls on every mode alike. `interleave=False` runs one server at
a time instead (start, every rate, SIGTERM, next mode) for machines short of memory. Without an
SLO, one is set at `slo_factor` times the first mode's unloaded median TTFT and TPOT. With
`loads` instead of `rates`, the rates are those fractions of the first mode's capacity, measured
after its unloaded requests (disagg.bench.capacity): the same fractions mean the same on any host.

Output directory:
  configs/<mode>.yaml         the config each server ran
  unloaded/<mode>.json        the sequential warm-up requests (unloaded latency)
  capacity.json               the first mode's measured capacity (with `loads`)
  runs/<mode>_rate<r>.json    one `disagg bench` result per (mode, rate)
  logs/<mode>.log             the server's output
  table.md, summary.csv, *.png, experiment.json
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from disagg.bench.capacity import Capacity, measure_capacity
from disagg.bench.launcher import Deployment
from disagg.bench.load_client import GrpcApi, load_requests, run_loop
from disagg.bench.metrics import RequestRecord, summarize
from disagg.bench.open_loop import LoadConfig, run_benchmark
from disagg.bench.report import load_runs, write_report
from disagg.bench.workloads import BenchRequest
from disagg.slo import SLO

MODE_CONFIGS = {
    "disaggregated": "disaggregated.yaml",  # 1 prefill + 1 decode worker, 1 core each
    "colocated-chunked": "colocated.yaml",  # 1 worker, 2 cores, chunked prefill (Sarathi)
    "colocated-prefill-first": "colocated-prefill-first.yaml",  # 1 worker, 2 cores, whole prompts first
}


@dataclass(frozen=True)
class ExperimentConfig:
    rates: tuple[float, ...]  # requests/s (or none, with `loads`)
    num_requests: int
    out_dir: str
    modes: tuple[str, ...] = tuple(MODE_CONFIGS)
    config_dir: str = "deploy/configs"
    slo: SLO | None = None  # None: slo_factor x the first mode's unloaded medians
    slo_factor: float = 4.0
    num_unloaded: int = 4
    burstiness: float = 1.0
    seed: int = 0
    max_concurrency: int | None = None
    interleave: bool = True  # all servers up at once, modes alternating at each rate
    # mode -> config file, for modes that are not MODE_CONFIGS' (e.g. a plan's candidates)
    config_files: dict[str, str] | None = None
    # Instead of `rates`: fractions of the first mode's capacity, measured with `capacity_requests`
    # requests of its own at `capacity_streams` closed-loop streams.
    loads: tuple[float, ...] = ()
    capacity_requests: int = 48
    capacity_streams: int = 16

    def __post_init__(self) -> None:
        if bool(self.rates) == bool(self.loads):
            raise ValueError("experiment: give rates or loads (fractions of the measured capacity), not both")

    @property
    def levels(self) -> tuple[float, ...]:
        return self.rates or self.loads


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
    servers = {mode: _server(exp, mode, out) for mode in exp.modes}
    if exp.interleave:
        with contextlib.ExitStack() as stack:
            for mode, server in servers.items():
                log(f"[{mode}] starting `disagg serve --config {server.config_path}`")
                stack.callback(server.stop)
                server.start()
            for server in servers.values():
                server.wait_ready()
            for mode, server in servers.items():
                phases.unloaded(mode, server.address)
            for i, rate in enumerate(phases.rates(exp.modes[0], servers[exp.modes[0]].address)):
                for mode in exp.modes[i % len(exp.modes) :] + exp.modes[: i % len(exp.modes)]:  # rotated turns
                    phases.at_rate(mode, servers[mode].address, i, rate, servers[mode].config_path)
    else:
        for mode, server in servers.items():
            log(f"[{mode}] starting `disagg serve --config {server.config_path}`")
            with server:
                phases.unloaded(mode, server.address)
                for i, rate in enumerate(phases.rates(mode, server.address)):
                    phases.at_rate(mode, server.address, i, rate, server.config_path)
            log(f"[{mode}] server stopped")
    paths = write_report(load_runs([str(out / "runs")]), str(out), phases.slo)
    _save(out / "experiment.json", phases.description())
    return paths


def _server(exp: ExperimentConfig, mode: str, out: Path) -> Deployment:
    """The mode's config (with the experiment's SLO, so that its goodput placement admits by the
    targets the experiment measures against), brought up by the launcher."""
    files = exp.config_files or {}
    if mode not in MODE_CONFIGS and mode not in files:
        raise ValueError(f"mode: {mode!r} is not one of {', '.join([*MODE_CONFIGS, *files])}")
    source = files[mode] if mode in files else str(Path(exp.config_dir) / MODE_CONFIGS[mode])
    settings = {"slo": exp.slo.to_dict()} if exp.slo else {}
    return Deployment(settings, base=source, workdir=out / "configs", name=mode, log=out / "logs" / f"{mode}.log")


class _Phases:
    """The experiment's kinds of measurement, saving each result as it comes."""

    def __init__(self, exp: ExperimentConfig, requests: list[BenchRequest], workload: dict, out: Path, log):
        self.exp, self.requests, self.workload, self.out, self.log = exp, requests, workload, out, log
        self.slo = exp.slo
        self.capacity: Capacity | None = None
        self._rates: tuple[float, ...] = exp.rates

    def unloaded(self, mode: str, address: str) -> None:
        """Sequential requests: the first warms the server up, the rest measure it unloaded."""
        exp = self.exp
        result = run_benchmark(
            address,
            _phase_requests(exp, self.requests, "unloaded"),
            LoadConfig(num_requests=exp.num_unloaded + 1, max_concurrency=1, seed=exp.seed),
        )
        records = [RequestRecord.from_dict(r) for r in result["requests"][1:]]
        result["summary"] = s = summarize(records, sum(r.e2el for r in records))
        _save(self.out / "unloaded" / f"{mode}.json", {**result, "label": mode, "workload": self.workload})
        self.log(
            f"[{mode}] unloaded: TTFT p50 {s['ttft_ms']['median']:.0f} ms, TPOT p50 {s['tpot_ms']['median']:.1f} ms"
        )
        if self.slo is None:
            self.slo = SLO(
                ttft_ms=round(exp.slo_factor * s["ttft_ms"]["median"], -1),
                tpot_ms=round(exp.slo_factor * s["tpot_ms"]["median"]),
            )
            self.log(f"SLO set to {exp.slo_factor:g}x the unloaded medians of {mode}: {self.slo}")

    def rates(self, mode: str, address: str) -> tuple[float, ...]:
        """The rates to run: as given, or the loads times `mode`'s capacity (measured once)."""
        if not self._rates:
            requests = load_requests(_phase_requests(self.exp, self.requests, "capacity"))
            self.capacity = run_loop(GrpcApi(address), measure_capacity, requests, self.exp.capacity_streams)
            self._rates = tuple(round(self.capacity.rate(load), 3) for load in self.exp.loads)
            _save(self.out / "capacity.json", {"mode": mode, **self.capacity.to_dict()})
            for load, rate in zip(self.exp.loads, self._rates):
                self.log(f"[{mode}] {self.capacity.describe(load)}: {rate:g} req/s")
        return self._rates

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

    def description(self) -> dict:
        exp = self.exp
        return {
            "rates": list(self._rates),
            "loads": list(exp.loads),
            "capacity": self.capacity.to_dict() if self.capacity else None,
            "num_requests": exp.num_requests,
            "modes": list(exp.modes),
            "interleave": exp.interleave,
            "slo": self.slo.to_dict() if self.slo else None,
            "workload": self.workload,
            "burstiness": exp.burstiness,
            "seed": exp.seed,
        }


def workload_size(exp: ExperimentConfig) -> int:
    """Requests the experiment needs: every phase gets its own prompts, because the servers
    cache prefixes and a repeated prompt would skip its prefill."""
    return _capacity_end(exp) + exp.num_requests * len(exp.levels)


def _capacity_end(exp: ExperimentConfig) -> int:
    return exp.num_unloaded + 1 + (exp.capacity_requests if exp.loads else 0)


def _phase_requests(exp: ExperimentConfig, requests: list[BenchRequest], phase: str | int) -> list[BenchRequest]:
    """The requests of a phase ("unloaded", "capacity", or the index of a rate); the same for every mode."""
    if phase == "unloaded":
        return requests[: exp.num_unloaded + 1]
    if phase == "capacity":
        return requests[exp.num_unloaded + 1 : _capacity_end(exp)]
    first = _capacity_end(exp) + phase * exp.num_requests
    return requests[first : first + exp.num_requests]


def _save(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1) + "\n")
