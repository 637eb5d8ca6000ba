"""`make loadtest`: serve the default model (deploy/configs/disaggregated.yaml) on a free port,
run Locust headless against it for a bounded time, stop the server, write the reports.

    python loadtest/run_locust.py                         # 4 users, 30 s, chat workload
    python loadtest/run_locust.py --users 8 --run-time 60s --workload code
    python loadtest/run_locust.py --server 127.0.0.1:50051 # an already running server
    python loadtest/run_locust.py -- --max-tokens 32      # anything after -- goes to Locust

Reports (under --out-dir, default loadtest/results/locust): Locust's CSV (locust_stats.csv, ...)
and HTML (locust.html), the exact per-request rows (rows.csv), and `disagg report`'s table and
TTFT/TPOT CDFs of those rows (report/).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from pathlib import Path

from disagg.bench.experiment import ServeProcess, config_without_fixed_ports
from disagg.bench.report import load_runs, write_report

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(HERE.parent / "deploy" / "configs" / "disaggregated.yaml"))
    parser.add_argument("--server", help="HOST:PORT of a running server (then none is started)")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--spawn-rate", type=float, default=2.0)
    parser.add_argument("--run-time", default="30s")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--out-dir", default=str(HERE / "results" / "locust"))
    parser.add_argument("locust_args", nargs="*", help="after --: more Locust arguments")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        address = args.server
        if address is None:
            config = config_without_fixed_ports(Path(args.config), out / "serving-config.yaml")
            print(f"starting `disagg serve --config {args.config}` (log: {out / 'serve.log'}) ...", flush=True)
            address = stack.enter_context(ServeProcess(str(config), str(out / "serve.log"))).address
        print(f"running Locust for {args.run_time} against {address} ...", flush=True)
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
                "--host",
                address,
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
    paths = write_report(load_runs([str(out / "rows.csv")]), str(out / "report"))
    print(f"\nLocust: {out / 'locust_stats.csv'}, {out / 'locust.html'}\nper-request rows: {out / 'rows.csv'}")
    print("report: " + ", ".join(paths.values()))
    return code


if __name__ == "__main__":
    sys.exit(main())
