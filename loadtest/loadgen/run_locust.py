"""`make loadtest`: serve the default model (deploy/configs/disaggregated.yaml) on a free port,
run Locust headless against it for a bounded time, stop the server, write the reports.

    python -m loadtest.loadgen.run_locust                         # 4 users, 30 s, chat workload
    python -m loadtest.loadgen.run_locust --users 8 --run-time 60s --workload code
    python -m loadtest.loadgen.run_locust --server 127.0.0.1:50051 # an already running server
    python -m loadtest.loadgen.run_locust -- --max-tokens 32      # anything after -- goes to Locust
    python -m loadtest.loadgen.run_locust --http                  # HttpGenerateUser: the OpenAI-compatible API

Reports (under --out-dir, default loadtest/results/locust): Locust's CSV (locust_stats.csv, ...)
with SLO attainment, goodput and TTFT/TPOT percentiles (locust_slo.csv, locust_slo_history.csv),
HTML (locust.html, with the same figures), the exact per-request rows (rows.csv), and
`disagg report`'s table and TTFT/TPOT CDFs of those rows (report/).
With --http the requests are judged by the server's default SLO, read over gRPC (the HTTP API
does not say it), unless Locust's --slo-ttft-ms / --slo-tpot-ms are given after --.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from pathlib import Path

from disagg.bench.launcher import Deployment
from disagg.bench.metrics import read_rows
from disagg.bench.report import load_runs, write_report
from disagg.bench.results import REPO, host_line
from disagg.client import DisaggClient

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "deploy" / "configs" / "disaggregated.yaml"))
    parser.add_argument("--server", help="HOST:PORT of a running server's gRPC API (then none is started)")
    parser.add_argument("--http", action="store_true", help="HttpGenerateUser instead of the gRPC GenerateUser")
    parser.add_argument("--http-url", help="with --server: its HTTP API (default http://127.0.0.1:8000)")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--spawn-rate", type=float, default=2.0)
    parser.add_argument("--run-time", default="30s")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--out-dir", default=str(REPO / "loadtest" / "results" / "locust"))
    parser.add_argument("locust_args", nargs="*", help="after --: more Locust arguments")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(host_line(), flush=True)
    with contextlib.ExitStack() as stack:
        address, http_url = args.server, args.http_url or "http://127.0.0.1:8000"
        if address is None:
            print(f"starting `disagg serve --config {args.config}` (log: {out / 'serve.log'}) ...", flush=True)
            server = Deployment(
                {}, base=args.config, workdir=out, name="serving-config", log=out / "serve.log", http=args.http
            )
            address, http_url = stack.enter_context(server).address, server.http_url
        users = ["HttpGenerateUser", "--host", http_url, *_server_slo(address)] if args.http else ["--host", address]
        print(f"running Locust for {args.run_time} against {http_url if args.http else address} ...", flush=True)
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "locust",
                "-f",
                str(HERE / "locustfile.py"),
                "--headless",
                "--only-summary",
                "-u",
                str(args.users),
                "-r",
                str(args.spawn_rate),
                "-t",
                args.run_time,
                "--stop-timeout",
                "120",
                *users,
                "--csv",
                str(out / "locust"),
                "--html",
                str(out / "locust.html"),
                "--rows-csv",
                str(out / "rows.csv"),
                "--workload",
                args.workload,
                *args.locust_args,
            ]
        )
    rows = out / "rows.csv"
    if not rows.exists() or not read_rows(str(rows)):  # the users' workload is made inside --run-time
        print(f"no request finished within --run-time {args.run_time} (Locust's exit code {code}): no report")
        return code or 1
    paths = write_report(load_runs([str(rows)]), str(out / "report"))
    print(f"\nLocust: {out / 'locust_stats.csv'}, {out / 'locust.html'}\nper-request rows: {out / 'rows.csv'}")
    print(f"SLO attainment, goodput, TTFT/TPOT percentiles: {out / 'locust_slo.csv'}")
    print("report: " + ", ".join(paths.values()))
    return code


def _server_slo(address: str) -> list[str]:
    """Locust's options that judge HTTP requests by the server's default SLO."""
    with DisaggClient(address) as client:
        slo = client.cluster_status(timeout=30).default_slo
    return ["--slo-ttft-ms", f"{slo.ttft_ms:g}", "--slo-tpot-ms", f"{slo.tpot_ms:g}"]


if __name__ == "__main__":
    sys.exit(main())
