"""A running tally of a load test's requests against an SLO: attainment, goodput and TTFT/TPOT
percentiles as the requests come, with the definitions of disagg.bench.metrics (a failed request
is a miss; percentiles by linear interpolation), so that the live figures of a run equal what
`summarize` computes from its exact rows afterwards.

Tallies are plain data that add up: a Locust worker sends what it counted since its last report
(`take`), and the master `merge`s it into its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.bench.metrics import RequestRecord, distribution_ms, meets_slo
from disagg.slo import SLO

FIGURE_FIELDS = (
    "requests",
    "succeeded",
    "good",
    "attainment_pct",
    "goodput_rps",
    "throughput_rps",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p90_ms",
    "tpot_p99_ms",
)


@dataclass
class SloTally:
    """What the requests judged by `slo` came to (no target: only failures miss)."""

    slo: SLO = field(default_factory=SLO)
    requests: int = 0
    succeeded: int = 0
    good: int = 0
    ttft_s: list[float] = field(default_factory=list)  # of the requests that succeeded
    tpot_s: list[float] = field(default_factory=list)  # of those with more than one output token

    def add(self, record: RequestRecord) -> None:
        self.requests += 1
        self.good += meets_slo(record, self.slo)
        if not record.success:
            return
        self.succeeded += 1
        self.ttft_s.append(record.ttft)
        if record.output_len > 1:
            self.tpot_s.append(record.tpot)

    def merge(self, other: SloTally) -> None:
        if other.slo.any and self.slo.any and other.slo != self.slo:
            raise ValueError(f"slo tally: cannot merge requests judged by {other.slo} into {self.slo}")
        self.slo = self.slo if self.slo.any else other.slo
        self.requests += other.requests
        self.succeeded += other.succeeded
        self.good += other.good
        self.ttft_s += other.ttft_s
        self.tpot_s += other.tpot_s

    def take(self) -> SloTally:
        """What was counted so far, leaving this tally empty (a worker's report to its master)."""
        taken = SloTally(self.slo, self.requests, self.succeeded, self.good, self.ttft_s, self.tpot_s)
        self.requests = self.succeeded = self.good = 0
        self.ttft_s, self.tpot_s = [], []
        return taken

    @property
    def attainment_pct(self) -> float:
        """Percent of the requests that met the SLO (a failure is a miss); 0 without requests."""
        return 100.0 * self.good / self.requests if self.requests else 0.0

    def goodput(self, duration_s: float) -> float:
        """Requests per second of a run of `duration_s` that met the SLO."""
        return self.good / duration_s if duration_s > 0 else 0.0

    def figures(self, duration_s: float) -> dict[str, float]:
        """FIGURE_FIELDS over a run of `duration_s` seconds (the rates are per second of it)."""
        per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
        ttft, tpot = distribution_ms(self.ttft_s), distribution_ms(self.tpot_s)
        return {
            "requests": self.requests,
            "succeeded": self.succeeded,
            "good": self.good,
            "attainment_pct": self.attainment_pct,
            "goodput_rps": self.goodput(duration_s),
            "throughput_rps": per_s(self.succeeded),
            **{f"ttft_{p}_ms": ttft[p] for p in ("p50", "p90", "p99")},
            **{f"tpot_{p}_ms": tpot[p] for p in ("p50", "p90", "p99")},
        }

    def to_dict(self) -> dict:
        return {
            "slo": self.slo.to_dict(),
            "requests": self.requests,
            "succeeded": self.succeeded,
            "good": self.good,
            "ttft_s": list(self.ttft_s),
            "tpot_s": list(self.tpot_s),
        }

    @classmethod
    def from_dict(cls, data: dict) -> SloTally:
        slo = SLO.from_dict(data["slo"])
        return cls(slo, data["requests"], data["succeeded"], data["good"], data["ttft_s"], data["tpot_s"])


class SloBoard:
    """One tally per API the requests went through ("grpc", "http"), all judged by one SLO."""

    def __init__(self, slo: SLO):
        self.slo = slo
        self.tallies: dict[str, SloTally] = {}

    def add(self, api: str, record: RequestRecord) -> None:
        self._tally(api).add(record)

    def merge(self, reports: dict[str, dict]) -> None:
        """`reports`: api -> SloTally.to_dict(), as `take` made them on another process (a
        master learns the SLO from its workers' reports)."""
        for api, data in reports.items():
            tally = SloTally.from_dict(data)
            self.slo = self.slo if self.slo.any else tally.slo
            self._tally(api).merge(tally)

    def take(self) -> dict[str, dict]:
        return {api: tally.take().to_dict() for api, tally in self.tallies.items() if tally.requests}

    def rows(self, duration_s: float) -> list[dict]:
        """One row of figures per API (name, then FIGURE_FIELDS), and "Aggregated" over all of
        them where there are several."""
        rows = [{"name": api, **tally.figures(duration_s)} for api, tally in sorted(self.tallies.items())]
        if len(self.tallies) > 1:
            total = SloTally(self.slo)
            for tally in self.tallies.values():
                total.merge(tally)
            rows.append({"name": "Aggregated", **total.figures(duration_s)})
        return rows

    def reset(self) -> None:
        self.tallies = {}

    def _tally(self, api: str) -> SloTally:
        if api not in self.tallies:
            self.tallies[api] = SloTally(self.slo)
        return self.tallies[api]
