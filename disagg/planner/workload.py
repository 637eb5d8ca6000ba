"""What the simulator replays: requests as (arrival, prompt length, output length), from a trace
file or drawn from a distribution.

Traces are in the format of DistServe's measured runs (../shared/data/distserve/*.json):
    {"config": {...}, "slo": {"ttft_ms": .., "tpot_ms": ..}, "model": .., "requests":
     [{"prompt_len": .., "output_len": .., "arrival_s": .., "ttft_ms": .., "tpot_ms": ..}, ...]}
where `ttft_ms` / `tpot_ms` (what the real system measured) are optional.

Pure Python: `disagg bench`'s own workloads (numpy) are turned into these by the CLI.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from disagg.slo import SLO


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    # What the engine orders by: vLLM's priority (critical -1, standard 0, sheddable 1) and, for
    # a pool under scheduling_order ltr, a ranker's guess at output_len (None: no guess;
    # disagg.planner.predicted_lengths fills it).
    priority: int = 0
    predicted_output_len: int | None = None
    slo: SLO | None = None  # its own targets (None: the server's)

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1 or self.arrival_s < 0:
            raise ValueError(f"request {self.index}: prompt_len, output_len >= 1 and arrival_s >= 0 are required")


@dataclass
class Trace:
    requests: list[SimRequest]
    config: dict = field(default_factory=dict)  # the serving config it ran under, if recorded
    slo: SLO = field(default_factory=SLO)
    model: str | None = None
    measured: list[dict] = field(default_factory=list)  # per request: ttft_ms, tpot_ms where given

    @property
    def duration_s(self) -> float:
        return max((r.arrival_s for r in self.requests), default=0.0)


def load_trace(path: str) -> Trace:
    try:
        data = json.loads(Path(path).read_text())
        rows = data["requests"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"trace {path}: not a trace file with a 'requests' list ({exc})") from None
    requests, measured = [], []
    for i, row in enumerate(rows):
        try:
            requests.append(SimRequest(i, float(row["arrival_s"]), int(row["prompt_len"]), int(row["output_len"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"trace {path}: request {i}: {exc}") from None
        measured.append({k: float(row[k]) for k in ("ttft_ms", "tpot_ms") if k in row})
    try:
        slo = SLO.from_dict(data.get("slo"))
    except ValueError as exc:
        raise ValueError(f"trace {path}: {exc}") from None
    return Trace(requests, data.get("config") or {}, slo, data.get("model"), measured)


def poisson_arrivals(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival times with gamma gaps (burstiness 1: Poisson), the first at 0, as `disagg bench`."""
    if not rate > 0 or not burstiness > 0:
        raise ValueError("rate and burstiness must be > 0")
    rng = random.Random(seed)
    times, now = [], 0.0
    for i in range(num_requests):
        if i:
            now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(now)
    return times


def with_rate(requests: list[SimRequest], rate: float, burstiness: float = 1.0, seed: int = 0) -> list[SimRequest]:
    """The same lengths arriving at another rate (the planner's search replays one workload at many)."""
    times = poisson_arrivals(len(requests), rate, burstiness, seed)
    return [replace(r, arrival_s=t) for r, t in zip(requests, times)]
