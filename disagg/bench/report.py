"""`disagg report`: a table and PNG plots for several benchmark runs side by side.

Reads `disagg bench` result files (JSON; a directory means every *.json in it) and Locust's
exact per-request rows (CSV). Metrics are recomputed from the per-request records, so a
different SLO can be applied afterwards (`--slo`). Writes:

  table.md, summary.csv       one row per run
  ttft_cdf.png, tpot_cdf.png  CDFs, one panel per label, one curve per rate
  attainment_vs_rate.png      SLO attainment (%) against request rate, one line per label
  goodput_vs_rate.png         goodput (req/s) against request rate, one line per label
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

from disagg.bench.metrics import RequestRecord, read_rows, slo_targets, summarize
from disagg.slo import SLO


@dataclass
class Run:
    label: str
    rate: float  # requests/s offered; inf for all-at-once or closed-loop (Locust)
    records: list[RequestRecord]
    duration_s: float
    slo: SLO
    summary: dict | None = None

    @property
    def name(self) -> str:
        return f"{self.label} @ {self.rate:g} req/s" if math.isfinite(self.rate) else self.label


def load_runs(paths: list[str]) -> list[Run]:
    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.json")) if p.is_dir() else [p]
    if not files:
        raise ValueError(f"no result files in {', '.join(paths)}")
    return [_load_csv(f) if f.suffix == ".csv" else _load_json(f) for f in files]


def _load_json(path: Path) -> Run:
    data = json.loads(path.read_text())
    if "requests" not in data or "summary" not in data:
        raise ValueError(f"{path}: not a `disagg bench` result file")
    rate = data["load"]["request_rate"]
    return Run(
        data.get("label") or path.stem,
        float(rate),
        [RequestRecord.from_dict(r) for r in data["requests"]],
        data["summary"]["duration_s"],
        SLO.from_dict(data["summary"]["slo"]),
    )


def _load_csv(path: Path) -> Run:
    records = read_rows(str(path))
    # Closed loop: the duration is from the first send to the last completion.
    end = max((r.sent_at + r.e2el for r in records), default=0.0)
    start = min((r.sent_at for r in records), default=0.0)
    return Run(path.stem, math.inf, records, end - start, SLO())


def write_report(runs: list[Run], out_dir: str, slo: SLO | None = None) -> dict[str, str]:
    """Summaries (with `slo` if given, else each run's own), table and plots; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for run in runs:
        if slo is not None:
            run.slo = slo
        run.summary = summarize(run.records, run.duration_s, run.slo)
    runs = sorted(runs, key=lambda r: (r.label, r.rate))
    paths = {"table": str(out / "table.md"), "csv": str(out / "summary.csv")}
    Path(paths["table"]).write_text(markdown_table(runs) + "\n")
    _write_csv(runs, paths["csv"])
    paths.update(_plots(runs, out))
    return paths


TABLE_COLUMNS = (
    ("mode / run", lambda r: r.label),
    ("rate (req/s)", lambda r: f"{r.rate:g}" if math.isfinite(r.rate) else "-"),
    ("requests", lambda r: str(r.summary["num_requests"])),
    ("failed", lambda r: str(r.summary["failed"])),
    ("throughput (req/s)", lambda r: f"{r.summary['request_throughput']:.2f}"),
    ("TTFT p50 / p90 (ms)", lambda r: f"{r.summary['ttft_ms']['median']:.0f} / {r.summary['ttft_ms']['p90']:.0f}"),
    ("TPOT p50 / p90 (ms)", lambda r: f"{r.summary['tpot_ms']['median']:.0f} / {r.summary['tpot_ms']['p90']:.0f}"),
    ("ITL p50 (ms)", lambda r: f"{r.summary['itl_ms']['median']:.0f}"),
    ("E2EL p50 (ms)", lambda r: f"{r.summary['e2el_ms']['median']:.0f}"),
    ("SLO attainment (%)", lambda r: f"{r.summary['slo_attainment_pct']:.1f}" if r.slo.any else "-"),
    ("goodput (req/s)", lambda r: f"{r.summary['goodput']:.2f}" if r.slo.any else "-"),
)


def markdown_table(runs: list[Run]) -> str:
    slos = {json.dumps(slo_targets(r.slo), sort_keys=True) for r in runs if r.slo.any}
    lines = ["| " + " | ".join(name for name, _ in TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(r) for _, cell in TABLE_COLUMNS) + " |" for r in runs]
    if slos:
        lines.append(
            "\nSLO: " + "; ".join(", ".join(f"{k} <= {v:g}" for k, v in json.loads(s).items()) for s in sorted(slos))
        )
    return "\n".join(lines)


def _write_csv(runs: list[Run], path: str) -> None:
    keys = (
        "num_requests",
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "output_throughput",
        "slo_attainment_pct",
        "goodput",
    )
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "label",
                "rate",
                *keys,
                *(
                    f"{m}_{s}"
                    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
                    for s in ("mean", "median", "p90", "p99")
                ),
                "slo",
            ]
        )
        for r in runs:
            s = r.summary
            writer.writerow(
                [
                    r.label,
                    r.rate,
                    *(s[k] for k in keys),
                    *(
                        s[m][st]
                        for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
                        for st in ("mean", "median", "p90", "p99")
                    ),
                    json.dumps(slo_targets(r.slo)),
                ]
            )


# ---- plots -------------------------------------------------------------------------------------
def _plots(runs: list[Run], out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    paths = {}
    for metric, attr, slo_key in (("ttft", lambda r: r.ttft, "ttft_ms"), ("tpot", lambda r: r.tpot, "tpot_ms")):
        paths[f"{metric}_cdf"] = str(out / f"{metric}_cdf.png")
        _cdf_figure(plt, ticker, runs, metric.upper(), attr, slo_key, paths[f"{metric}_cdf"])
    rated = [r for r in runs if math.isfinite(r.rate) and r.slo.any]
    if rated:
        paths["attainment_vs_rate"] = str(out / "attainment_vs_rate.png")
        _rate_figure(plt, rated, "slo_attainment_pct", "SLO attainment (%)", paths["attainment_vs_rate"])
        paths["goodput_vs_rate"] = str(out / "goodput_vs_rate.png")
        _rate_figure(plt, rated, "goodput", "goodput (req/s meeting every SLO)", paths["goodput_vs_rate"])
    return paths


def _by_label(runs: list[Run]) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.label, []).append(r)
    return groups


def _log_axis(ax, ticker) -> None:
    """Log scale labelled 1-2-5 in plain numbers (matplotlib's 3x10^2 labels collide)."""
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(ticker.NullFormatter())


def _cdf_figure(plt, ticker, runs: list[Run], metric: str, value_of, slo_key: str, path: str) -> None:
    groups = _by_label(runs)
    fig, axes = plt.subplots(
        1, len(groups), figsize=(4.2 * len(groups) + 0.8, 3.6), sharex=True, sharey=True, squeeze=False
    )
    for ax, (label, group) in zip(axes[0], groups.items()):
        for run in group:
            values = sorted(
                value_of(r) * 1e3 for r in run.records if r.success and (metric != "TPOT" or r.output_len > 1)
            )
            if values:
                ax.step(
                    values,
                    [(i + 1) / len(values) for i in range(len(values))],
                    where="post",
                    label=f"{run.rate:g} req/s" if math.isfinite(run.rate) else run.label,
                )
        limit = getattr(group[0].slo, slo_key)
        if limit:
            ax.axvline(limit, color="grey", linestyle="--", linewidth=1, label=f"SLO {limit:g} ms")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel(f"{metric} (ms)")
        _log_axis(ax, ticker)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("fraction of requests")
    fig.suptitle(f"{metric} CDF")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rate_figure(plt, runs: list[Run], key: str, ylabel: str, path: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, group in _by_label(runs).items():
        ax.plot([r.rate for r in group], [r.summary[key] for r in group], marker="o", label=label)
    if key == "goodput":
        rates = sorted({r.rate for r in runs})
        ax.plot(rates, rates, color="grey", linestyle=":", linewidth=1, label="offered rate")
    else:
        ax.set_ylim(-2, 102)
    slo = slo_targets(runs[0].slo)
    ax.set_title(f"{ylabel}\nSLO: " + ", ".join(f"{k} <= {v:g}" for k, v in slo.items()), fontsize=10)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
