"""The open-loop benchmark behind `disagg bench`: requests arrive on a Poisson (or gamma, for
burstiness) schedule whatever the server's progress, as vLLM's `bench serve`; the load client
(disagg.bench.load_client) sends them.

Arrival gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): burstiness 1 is Poisson,
below 1 burstier, above 1 more regular; rate inf sends everything at once. The schedule is
absolute (request i is due at start + t_i), so slow sends do not stretch it. With a concurrency
cap a due request waits for a free slot, and its latencies count from when it is sent.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from disagg.bench.load_client import GrpcApi, load_requests, open_loop, run_loop
from disagg.bench.metrics import summarize
from disagg.bench.results import host_facts
from disagg.bench.workloads import BenchRequest
from disagg.slo import SLO


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf  # requests/s
    burstiness: float = 1.0
    num_requests: int | None = 100  # or a duration
    duration_s: float | None = None
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 600.0  # per request
    temperature: float = 0.0

    def __post_init__(self):
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("give exactly one of num_requests and duration")
        if not self.request_rate > 0 or not self.burstiness > 0:
            raise ValueError("request_rate and burstiness must be > 0")
        if self.duration_s is not None and math.isinf(self.request_rate):
            raise ValueError("a duration needs a finite request rate")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")


def arrival_times(load: LoadConfig) -> list[float]:
    """Seconds after the start at which each request is due (the first at 0, as vLLM)."""
    if math.isinf(load.request_rate):
        return [0.0] * load.num_requests
    rng = np.random.default_rng(load.seed)
    gaps = lambda n: rng.gamma(load.burstiness, 1.0 / (load.request_rate * load.burstiness), n)  # noqa: E731
    if load.num_requests is not None:
        return np.concatenate([[0.0], np.cumsum(gaps(load.num_requests - 1))])[: load.num_requests].tolist()
    times = [0.0]
    while True:
        for gap in gaps(64):
            if times[-1] + gap >= load.duration_s:
                return times
            times.append(times[-1] + float(gap))


def run_benchmark(
    address: str,
    requests: list[BenchRequest],
    load: LoadConfig,
    slo: SLO | None = None,
    api_key: str | None = None,
    tls_ca: str | None = None,
) -> dict:
    """Send `requests` on `load`'s schedule over gRPC (cycling through them for a duration); the
    result dict (metadata, summary and every request's record), ready to save as JSON."""
    arrivals = arrival_times(load)
    api = GrpcApi(address, api_key=api_key, tls_ca=tls_ca, timeout_s=load.timeout_s)
    sent = load_requests(requests, load.temperature)
    run = run_loop(api, open_loop, sent, arrivals, load.max_concurrency)
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "address": address,
        "machine": host_facts(),
        "load": {
            "request_rate": load.request_rate if math.isfinite(load.request_rate) else "inf",
            "burstiness": load.burstiness,
            "num_requests": len(arrivals),
            "duration_s": load.duration_s,
            "max_concurrency": load.max_concurrency,
            "seed": load.seed,
            "temperature": load.temperature,
        },
        "summary": summarize(run.records, run.duration_s, slo),
        "requests": [r.to_dict() for r in run.records],
    }
