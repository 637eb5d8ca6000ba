"""Per-request records and the metrics of vLLM's `bench serve`, with SLO attainment and goodput.

Definitions (as vLLM's benchmark_serving):
- TTFT: request sent to the first message carrying tokens.
- TPOT: (E2EL - TTFT) / (output tokens - 1), per request with more than one output token.
- ITL: gaps between consecutive tokens; a message carrying k tokens counts as k tokens that
  share the gap since the previous message equally (tokens beside the first one in the first
  message have gap 0).
- E2EL: request sent to the last message.
- Statistics: mean, median, std, and percentiles by linear interpolation (numpy's default).
- SLO attainment: percent of ALL requests sent (failures count as misses) that met the SLO (disagg.slo.met).
- Goodput: requests per second (over the benchmark's duration) that met the SLO.
Times are kept in seconds, reported in milliseconds.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from disagg.slo import SLO, met, missed, tpot_s

DEFAULT_PERCENTILES = (50, 90, 99)
UNSAVED_FIELDS = ("token_ids", "text", "token_times", "retried")


@dataclass
class RequestRecord:
    index: int  # position in the workload
    prompt_len: int
    target_output_len: int
    request_id: str = ""
    sent_at: float = 0.0  # seconds since the benchmark started
    success: bool = False
    output_len: int = 0  # tokens received
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error_code: str = ""  # gRPC status code name of a failure
    error: str = ""
    finish_reason: str = ""
    server: dict = field(default_factory=dict)  # the final message's usage and timings
    # What came back, for the scripts that check it (not saved by to_dict): the tokens (gRPC),
    # the text, and when each streamed piece arrived (a gRPC token; an HTTP chunk that carried
    # text), in seconds since the benchmark started.
    token_ids: list[int] = field(default_factory=list, repr=False)
    text: str = field(default="", repr=False)
    token_times: list[float] = field(default_factory=list, repr=False)
    retried: bool = field(default=False, repr=False)  # sent once more, through another frontend, after a failure

    @property
    def tpot(self) -> float:
        return tpot_s(self.e2el, self.ttft, self.output_len)

    def to_dict(self) -> dict:
        saved = {k: v for k, v in asdict(self).items() if k not in UNSAVED_FIELDS}
        return {**saved, "tpot": self.tpot}

    @classmethod
    def from_dict(cls, data: dict) -> "RequestRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class TokenTimer:
    """Client-side timings of one stream; feed each message's token count and arrival time."""

    def __init__(self, started: float):
        self.started = started
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.num_tokens = 0
        self.itl: list[float] = []

    def on_message(self, num_tokens: int, now: float) -> None:
        if num_tokens == 0:
            return
        if self.first_at is None:
            self.first_at = now
            self.itl += [0.0] * (num_tokens - 1)
        else:
            self.itl += [(now - self.last_at) / num_tokens] * num_tokens
        self.last_at = now
        self.num_tokens += num_tokens

    def finish(self, record: RequestRecord, now: float) -> RequestRecord:
        record.success = True
        record.output_len = self.num_tokens
        record.ttft = (self.first_at if self.first_at is not None else now) - self.started
        record.e2el = now - self.started
        record.itl = self.itl
        return record


# ---- SLOs --------------------------------------------------------------------------------------
def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """It succeeded and met `slo` (disagg.slo.met)."""
    return record.success and met(slo, record.ttft * 1e3, record.tpot * 1e3)


def slo_misses(record: RequestRecord, slo: SLO) -> list[str]:
    """What a request missed, e.g. ["TTFT > 500 ms"]: its error code if it failed (a refusal too),
    else each target it exceeded (disagg.slo.missed); [] exactly when `meets_slo`."""
    if not record.success:
        return [record.error_code or "FAILED"]
    return missed(slo, record.ttft * 1e3, record.tpot * 1e3)


def slo_targets(slo: SLO | None) -> dict[str, float]:
    """The targets a result file records: those given (a target of 0 is none)."""
    return {key: value for key, value in (slo or SLO()).to_dict().items() if value > 0}


# ---- statistics --------------------------------------------------------------------------------
def distribution_ms(values_s: list[float], percentiles=DEFAULT_PERCENTILES) -> dict[str, float]:
    """mean, median, std and pNN of seconds, in milliseconds (zeros when empty, as vLLM)."""
    x = np.asarray(values_s, dtype=float) * 1e3
    if x.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    return {
        "mean": float(x.mean()),
        "median": float(np.median(x)),
        "std": float(x.std()),
        **{f"p{p:g}": float(np.percentile(x, p)) for p in percentiles},
    }


def median_ci(
    runs: list[list[float]], confidence: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of the median of all values of all runs.

    Two levels: the runs are resampled, then the values within each run, so that what differs
    from one run to the next (fresh processes on a shared machine compute a few percent apart)
    widens the interval as it should. With one run it is the plain bootstrap of its values,
    which says nothing about the next run."""
    return bootstrap_ci([np.asarray(r, dtype=float) for r in runs], np.median, confidence, resamples, seed)


def median_difference_ci(
    runs_a: list[list[float]], runs_b: list[list[float]], confidence: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """The same for median(b) - median(a), where a run's i-th values of a and b belong together
    (one request on two sides): pairs are resampled, never split."""
    if len(runs_a) != len(runs_b) or any(len(a) != len(b) for a, b in zip(runs_a, runs_b)):
        raise ValueError("median_difference_ci: a and b need the same runs of the same lengths")
    pairs = [np.column_stack([np.asarray(a, dtype=float), np.asarray(b, dtype=float)]) for a, b in zip(runs_a, runs_b)]
    return bootstrap_ci(pairs, lambda rows: np.median(rows[:, 1]) - np.median(rows[:, 0]), confidence, resamples, seed)


def bootstrap_ci(
    runs: list[np.ndarray], statistic, confidence: float = 0.95, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """Two-level percentile bootstrap of `statistic` (rows -> float) over all runs' rows pooled."""
    if not runs or any(len(r) == 0 for r in runs):
        raise ValueError("bootstrap: every run needs values")
    if not 0 < confidence < 1:
        raise ValueError(f"bootstrap: confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    estimates = np.empty(resamples)
    for i in range(resamples):
        chosen = rng.integers(len(runs), size=len(runs))
        estimates[i] = statistic(
            np.concatenate([runs[k][rng.integers(len(runs[k]), size=len(runs[k]))] for k in chosen])
        )
    tail = (1 - confidence) / 2 * 100
    return float(np.percentile(estimates, tail)), float(np.percentile(estimates, 100 - tail))


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    slo: SLO | None = None,
    percentiles=DEFAULT_PERCENTILES,
) -> dict:
    ok = [r for r in records if r.success]
    good = [r for r in records if meets_slo(r, slo or SLO())]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failures_by_code": dict(Counter(r.error_code for r in records if not r.success)),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "ttft_ms": distribution_ms([r.ttft for r in ok], percentiles),
        "tpot_ms": distribution_ms([r.tpot for r in ok if r.output_len > 1], percentiles),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl], percentiles),
        "e2el_ms": distribution_ms([r.e2el for r in ok], percentiles),
        "slo": slo_targets(slo),
        "num_good": len(good),
        "slo_attainment_pct": 100.0 * len(good) / len(records) if records else 0.0,
        "goodput": per_s(len(good)),
    }


def attainment_crossing(points: list[tuple[float, float]], threshold: float = 90.0) -> dict:
    """Where SLO attainment first falls below `threshold` percent in a rate sweep of (rate,
    attainment %) points: the first rate below it, and the crossing interpolated linearly from the
    rate before it (None where the sweep starts below it, or never goes there)."""
    points = sorted(points)
    for i, (rate, attainment) in enumerate(points):
        if attainment < threshold:
            if i == 0:
                return {"first_rate_below": rate, "crossing": None}
            r0, a0 = points[i - 1]
            crossing = r0 + (rate - r0) * (a0 - threshold) / (a0 - attainment)
            return {"first_rate_below": rate, "crossing": round(crossing, 3)}
    return {"first_rate_below": None, "crossing": None}


def format_summary(summary: dict, title: str = "Serving Benchmark Result") -> str:
    """The console block `disagg bench` prints (laid out like vLLM's)."""
    lines = [f"{' ' + title + ' ':=^60}"]
    row = lambda name, value: lines.append(f"{name:<44}{value:>16}")  # noqa: E731
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    for code, count in sorted(summary["failures_by_code"].items()):
        row(f"  {code}:", count)
    row("Benchmark duration (s):", f"{summary['duration_s']:.2f}")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", f"{summary['request_throughput']:.2f}")
    row("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}")
    if summary["slo"]:
        slo = ", ".join(f"{k}<={v:g}" for k, v in summary["slo"].items())
        row(f"SLO attainment ({slo}) (%):", f"{summary['slo_attainment_pct']:.1f}")
        row("Request goodput (req/s):", f"{summary['goodput']:.2f}")
    for key, name in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "Inter-token Latency"),
        ("e2el_ms", "End-to-end Latency"),
    ):
        lines.append(f"{' ' + name + ' ':-^60}")
        for stat, value in summary[key].items():
            row(
                f"{stat.capitalize() if stat in ('mean', 'median', 'std') else stat.upper()} {key.split('_')[0].upper()} (ms):",
                f"{value:.2f}",
            )
    lines.append("=" * 60)
    return "\n".join(lines)


# ---- exact per-request rows (CSV), shared by the Locust user and the report --------------------
ROW_FIELDS = (
    "request_id",
    "index",
    "sent_at",
    "prompt_len",
    "target_output_len",
    "output_len",
    "success",
    "error_code",
    "ttft_s",
    "tpot_s",
    "e2el_s",
    "itl_s",
    "finish_reason",
)


def record_row(record: RequestRecord) -> dict:
    return {
        "request_id": record.request_id,
        "index": record.index,
        "sent_at": f"{record.sent_at:.6f}",
        "prompt_len": record.prompt_len,
        "target_output_len": record.target_output_len,
        "output_len": record.output_len,
        "success": int(record.success),
        "error_code": record.error_code,
        "ttft_s": f"{record.ttft:.6f}",
        "tpot_s": f"{record.tpot:.6f}",
        "e2el_s": f"{record.e2el:.6f}",
        "itl_s": json.dumps([round(g, 6) for g in record.itl]),
        "finish_reason": record.finish_reason,
    }


def read_rows(path: str) -> list[RequestRecord]:
    with open(path, newline="") as f:
        return [
            RequestRecord(
                index=int(row["index"]),
                prompt_len=int(row["prompt_len"]),
                target_output_len=int(row["target_output_len"]),
                request_id=row["request_id"],
                sent_at=float(row["sent_at"]),
                success=row["success"] == "1",
                output_len=int(row["output_len"]),
                ttft=float(row["ttft_s"]),
                e2el=float(row["e2el_s"]),
                itl=json.loads(row["itl_s"] or "[]"),
                error_code=row["error_code"],
                finish_reason=row["finish_reason"],
            )
            for row in csv.DictReader(f)
        ]
