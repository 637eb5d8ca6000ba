"""Load-testing tools against a real server (default model, 1 prefill + 1 decode worker):
`disagg bench` (open loop), Locust headless (closed loop, over gRPC and over the HTTP API), and
`disagg report` on their output. Low load and short outputs: every request must succeed and the
reports must agree with each other (Locust's SLO figures with the exact rows).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.bench.launcher import free_port
from disagg.bench.metrics import read_rows, slo_misses, summarize
from disagg.cli import main as disagg_main
from disagg.server import Server
from disagg.config import ServingConfig
from disagg.slo import SLO

REPO = Path(__file__).resolve().parents[2]
NUM_REQUESTS = 12
SERVER_SLO = SLO(ttft_ms=30000.0, tpot_ms=1.0)


@pytest.fixture(scope="module")
def server(ray_session):
    config = ServingConfig.from_dict(
        {
            "engine": {"num_kv_blocks": 400, "max_num_batched_tokens": 256},
            "prefill": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "decode": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "port": 0,
            "http_port": free_port(),
            # Locust judges requests by the server's SLO: TTFT met by all, TPOT by none (placed
            # anyway: best effort), so both sides of its SLO events are seen
            "slo": SERVER_SLO.to_dict(),
            "slo_admission": "best_effort",
            "calibration_s": 0,  # placement is not what this tests (test_calibration.py is)
            "replan": False,  # Ray has room for more instances here: scaling would add one under load
        }
    )
    with Server(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("loadtest")


@pytest.fixture(scope="module")
def bench_result(server, out_dir) -> Path:
    path = out_dir / "bench.json"
    code = disagg_main(
        [
            "bench",
            "--server",
            server.address,
            "--workload",
            "chat",
            "--length-scale",
            "0.1",
            "--seed",
            "1",
            "--num-requests",
            str(NUM_REQUESTS),
            "--request-rate",
            "3",
            "--slo",
            "ttft_ms=30000,tpot_ms=5000",
            "-o",
            str(path),
        ]
    )
    assert code == 0
    return path


def run_locust(prefix: Path, *args: str, run_time: str = "8s") -> None:
    """Locust headless, 2 users, short chat requests, the reports under `prefix`."""
    command = [
        sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "loadgen" / "locustfile.py"), *args,
        "--headless", "--only-summary", "-u", "2", "-r", "2", "-t", run_time, "--stop-timeout", "60",
        "--csv", str(prefix), "--html", f"{prefix}.html", "--rows-csv", f"{prefix}_rows.csv",
        "--workload", "chat", "--length-scale", "0.1", "--max-tokens", "8", "--workload-size", "60",
        "--think-time", "0.2",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def locust_run(server, out_dir) -> Path:
    prefix = out_dir / "locust"
    run_locust(prefix, "--host", server.address)
    return prefix


@pytest.fixture(scope="module")
def locust_http_run(server, out_dir) -> Path:
    """HttpGenerateUser chosen by name; the HTTP API does not say the server's SLO: given here."""
    prefix = out_dir / "locust_http"
    slo = ["--slo-ttft-ms", f"{SERVER_SLO.ttft_ms:g}", "--slo-tpot-ms", f"{SERVER_SLO.tpot_ms:g}"]
    run_locust(prefix, "HttpGenerateUser", "--host", f"http://{server.http_address}", *slo, run_time="6s")
    return prefix


def slo_figures(prefix: Path) -> dict[str, dict]:
    with open(f"{prefix}_slo.csv", newline="") as f:
        return {row["name"]: row for row in csv.DictReader(f)}


def assert_slo_figures_agree_with_the_rows(prefix: Path, api: str) -> None:
    """Locust's SLO figures (CSV and HTML report) are `summarize` of the exact rows."""
    rows = read_rows(f"{prefix}_rows.csv")
    figures = slo_figures(prefix)
    assert set(figures) == {api}
    row = figures[api]
    duration = float(row["duration_s"])
    expected = summarize(rows, duration, SERVER_SLO)
    assert int(row["requests"]) == len(rows) and int(row["succeeded"]) == expected["completed"]
    assert int(row["good"]) == expected["num_good"]
    assert float(row["attainment_pct"]) == pytest.approx(expected["slo_attainment_pct"])
    assert float(row["goodput_rps"]) == pytest.approx(expected["goodput"])
    assert float(row["throughput_rps"]) == pytest.approx(len(rows) / duration)
    assert 0.5 < duration < 20, "from the users' start (after the workload is made) to their stop"
    for metric in ("ttft", "tpot"):
        for p in ("p50", "p90", "p99"):
            # the rows keep microseconds; the tally kept the unrounded times
            assert float(row[f"{metric}_{p}_ms"]) == pytest.approx(expected[f"{metric}_ms"][p], abs=0.01)
    assert row["slo"] == "ttft_ms=30000,tpot_ms=1"
    with open(f"{prefix}_slo_history.csv", newline="") as f:
        history = list(csv.DictReader(f))
    assert history and history[-1]["requests"] == row["requests"]  # the last line of the history is the end
    page = Path(f"{prefix}.html").read_text()
    section = page[page.index('<section id="disagg-slo"') :]
    assert page.count('id="disagg-slo"') == 1 and section.index("</section>") < section.index("</body>")
    cells = [f"<td>{api}</td>", f"<td>{len(rows)}</td>", f"<td>{round(float(row['attainment_pct']), 3)}</td>"]
    assert all(cell in section for cell in cells), section


def test_bench_against_a_real_server(bench_result):
    result = json.loads(bench_result.read_text())
    s = result["summary"]
    assert s["num_requests"] == s["completed"] == len(result["requests"]) == NUM_REQUESTS
    assert s["failed"] == 0 and s["failures_by_code"] == {}
    assert s["slo"] == {"ttft_ms": 30000.0, "tpot_ms": 5000.0}
    assert 0.0 <= s["slo_attainment_pct"] <= 100.0 and s["slo_attainment_pct"] == pytest.approx(
        100.0 * s["num_good"] / NUM_REQUESTS
    )
    assert 0.0 <= s["goodput"] <= s["request_throughput"] + 1e-9
    assert s["total_output_tokens"] == sum(r["output_len"] for r in result["requests"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(s[key]) == {"mean", "median", "std", "p50", "p90", "p99"} and s[key]["mean"] > 0
    assert result["load"]["request_rate"] == 3.0 and result["workload"]["name"] == "chat"
    for r in result["requests"]:
        assert r["success"] and r["error_code"] == ""
        assert 0 < r["ttft"] < r["e2el"], "TTFT below E2E latency for every request"
        assert r["output_len"] == r["target_output_len"] == r["server"]["completion_tokens"]
        assert r["prompt_len"] == r["server"]["prompt_tokens"], "the workload counts tokens as the server does"
        assert len(r["itl"]) == r["output_len"] - 1
        assert r["ttft"] >= r["server"]["ttft_s"] - 0.005 and r["e2el"] >= r["server"]["e2e_s"] - 0.005


def test_locust_headless_reports_agree_with_the_exact_rows(locust_run):
    rows = read_rows(f"{locust_run}_rows.csv")
    with open(f"{locust_run}_stats.csv", newline="") as f:
        stats = {row["Name"]: row for row in csv.DictReader(f)}
    assert Path(f"{locust_run}.html").stat().st_size > 0
    assert len(rows) >= 2
    assert int(stats["Generate E2E"]["Request Count"]) == len(rows)
    assert int(stats["Generate TTFT"]["Request Count"]) == len(rows)
    assert int(stats["Generate TPOT"]["Request Count"]) == sum(r.output_len > 1 for r in rows)
    assert int(stats["Generate ITL"]["Request Count"]) == sum(len(r.itl) for r in rows)
    assert all(
        int(row["Failure Count"]) == 0 for name, row in stats.items() if name not in ("Generate SLO", "Aggregated")
    )
    for r in rows:
        assert r.success and r.output_len == r.target_output_len <= 8
        assert 0 < r.ttft < r.e2el
    assert len({r.request_id for r in rows}) == len(rows)


def test_locust_slo_figures_agree_with_the_exact_rows(locust_run):
    assert_slo_figures_agree_with_the_rows(locust_run, "grpc")


def test_locust_http_user_streams_chat_completions(locust_http_run):
    rows = read_rows(f"{locust_http_run}_rows.csv")
    with open(f"{locust_http_run}_stats.csv", newline="") as f:
        stats = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    assert len(rows) >= 2 and all(r.success and r.finish_reason == "length" for r in rows)
    for r in rows:
        assert r.output_len == r.target_output_len <= 8, "usage's completion tokens, EOS ignored"
        assert 0 < r.ttft < r.e2el and 1 <= len(r.itl) <= r.output_len - 1
    assert int(stats[("http", "Generate E2E")]["Request Count"]) == len(rows)
    assert int(stats[("http", "Generate ITL")]["Request Count"]) == sum(len(r.itl) for r in rows)
    assert int(stats[("http", "Generate SLO")]["Failure Count"]) == sum(bool(slo_misses(r, SERVER_SLO)) for r in rows)
    assert not any(kind == "grpc" for kind, _ in stats), "with HttpGenerateUser named, the gRPC user stays idle"
    assert_slo_figures_agree_with_the_rows(locust_http_run, "http")


def test_locust_reports_slo_attainment_by_the_servers_slo(locust_run):
    rows = read_rows(f"{locust_run}_rows.csv")
    with open(f"{locust_run}_stats.csv", newline="") as f:
        slo = {row["Name"]: row for row in csv.DictReader(f)}["Generate SLO"]
    missed = [r for r in rows if slo_misses(r, SERVER_SLO)]
    assert missed and all(r.output_len > 1 for r in missed)  # TPOT > 1 ms; one token has no TPOT
    assert int(slo["Request Count"]) == len(rows) and int(slo["Failure Count"]) == len(missed)
    with open(f"{locust_run}_failures.csv", newline="") as f:
        reasons = [row["Error"] for row in csv.DictReader(f) if row["Name"] == "Generate SLO"]
    assert reasons == ["SloMissed('TPOT > 1 ms')"]  # one line per target missed


def test_locust_users_stream_at_the_same_time(locust_run):
    """Two closed-loop users overlap: a user waiting on its stream lets the other greenlet run.
    (The client reads streams on the calling thread; a blocking read there would stall every
    user of the process. Without Locust's monkey-patching, gRPC's threaded reader does that.)"""
    spans = sorted((r.sent_at, r.sent_at + r.e2el) for r in read_rows(f"{locust_run}_rows.csv"))
    overlapping = sum(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))
    assert overlapping >= len(spans) // 3, spans


def test_locust_step_load_shape_adds_users_and_stops_by_itself(server, out_dir):
    prefix = out_dir / "step"
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(REPO / "loadtest" / "loadgen" / "locustfile.py"),
        "--headless",
        "--only-summary",
        "--host",
        server.address,
        "--csv",
        str(prefix),
        "--rows-csv",
        f"{prefix}_rows.csv",
        "--stop-timeout",
        "60",
        "--step-users",
        "1",
        "--step-time",
        "3",
        "--step-count",
        "2",
        "--length-scale",
        "0.1",
        "--max-tokens",
        "4",
        "--workload-size",
        "20",
    ]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=90, env={**os.environ, "DISAGG_LOCUST_SHAPE": "step"}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Shape test" in done.stderr and "2 total users" in done.stderr
    rows = read_rows(f"{prefix}_rows.csv")
    assert rows and all(r.success for r in rows)


def test_report_writes_table_and_plots_from_bench_and_locust_output(bench_result, locust_run, out_dir):
    report = out_dir / "report"
    assert disagg_main(["report", str(bench_result), f"{locust_run}_rows.csv", "--out-dir", str(report)]) == 0
    for name in ("ttft_cdf", "tpot_cdf", "attainment_vs_rate", "goodput_vs_rate"):
        png = report / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    table = (report / "table.md").read_text()
    bench_row = next(line for line in table.splitlines() if line.startswith("| chat |"))
    cells = [c.strip() for c in bench_row.strip("|").split("|")]
    assert cells[1:4] == ["3", str(NUM_REQUESTS), "0"]  # rate, requests, failed
    assert cells[-2] == f"{json.loads(bench_result.read_text())['summary']['slo_attainment_pct']:.1f}"
    with open(report / "summary.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 2
