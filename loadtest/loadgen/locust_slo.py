"""SLO attainment, goodput and TTFT/TPOT percentiles as Locust figures of their own
(disagg.bench.slo_tally counts them; this puts them where Locust users look):

- the web UI: an "SLO" tab, refreshed with the request statistics, and a CSV download;
- `--csv PREFIX`: PREFIX_slo.csv (the figures now, rewritten as Locust rewrites PREFIX_stats.csv)
  and PREFIX_slo_history.csv (a row per API at every rewrite: the figures over time);
- `--html FILE`: an "SLO attainment" section in the report (and in the web UI's report download);
- distributed runs: each worker sends what it counted with its stats reports, the master adds it up.

Goodput and throughput are per second of the run (from the test's start, or the last stats
reset, to now; frozen when the test stops).
"""

from __future__ import annotations

import csv
import html
import io
import json
import os
import time

import gevent
from flask import Response, request
from locust.runners import MasterRunner, WorkerRunner
from locust.stats import CSV_STATS_INTERVAL_SEC

from disagg.bench.metrics import RequestRecord, slo_targets
from disagg.bench.slo_tally import FIGURE_FIELDS, SloBoard
from disagg.slo import SLO

TAB_KEY = "slo"
REPORT_KEY = "disagg_slo"  # the key of a worker's report to the master
CSV_FIELDS = ("name", *FIGURE_FIELDS, "duration_s", "slo")
HISTORY_FIELDS = ("timestamp", *CSV_FIELDS)
TITLES = {
    "name": "API",
    "requests": "Requests",
    "succeeded": "Succeeded",
    "good": "Met SLO",
    "attainment_pct": "SLO attainment (%)",
    "goodput_rps": "Goodput (req/s)",
    "throughput_rps": "Throughput (req/s)",
    **{f"{m}_{p}_ms": f"{m.upper()} {p} (ms)" for m in ("ttft", "tpot") for p in ("p50", "p90", "p99")},
    "duration_s": "Duration (s)",
    "slo": "SLO",
}


class SloReport:
    """The run's SLO board and every place its figures go."""

    def __init__(self, environment):
        self.environment = environment
        self.board = SloBoard(SLO())
        self.started = time.time()
        self.stopped: float | None = None
        self.csv_prefix = getattr(environment.parsed_options, "csv_prefix", None)
        self._history = None
        self._writer: gevent.Greenlet | None = None
        self._hook_events()

    # ---- counting ----------------------------------------------------------------------------------
    def judge_by(self, slo: SLO) -> None:
        """The SLO requests are judged by, once it is known (at the test's start)."""
        self.board = SloBoard(slo)

    def add(self, api: str, record: RequestRecord) -> None:
        self.board.add(api, record)

    def rows(self) -> list[dict]:
        duration = (self.stopped or time.time()) - self.started
        slo = ",".join(f"{k}={v:g}" for k, v in slo_targets(self.board.slo).items()) or "none"
        return [{**row, "duration_s": duration, "slo": slo} for row in self.board.rows(duration)]

    # ---- Locust's events ---------------------------------------------------------------------------
    def _hook_events(self) -> None:
        events = self.environment.events
        events.test_start.add_listener(self._on_test_start)
        events.test_stop.add_listener(self._on_test_stop)
        events.reset_stats.add_listener(self._on_reset_stats)
        events.quitting.add_listener(self._on_quitting)
        if isinstance(self.environment.runner, WorkerRunner):
            events.report_to_master.add_listener(self._on_report_to_master)
        if isinstance(self.environment.runner, MasterRunner):
            events.worker_report.add_listener(self._on_worker_report)
        if self.environment.web_ui is not None:
            self._extend_web_ui(self.environment.web_ui)

    def _on_test_start(self, **_) -> None:
        self.started, self.stopped = time.time(), None
        if self.csv_prefix and self._writer is None and not isinstance(self.environment.runner, WorkerRunner):
            self._history = open(f"{self.csv_prefix}_slo_history.csv", "w", newline="")  # noqa: SIM115
            csv.DictWriter(self._history, HISTORY_FIELDS).writeheader()
            self._writer = gevent.spawn(self._write_csv_forever)

    def _on_test_stop(self, **_) -> None:
        self.stopped = time.time()

    def _on_reset_stats(self, **_) -> None:
        self.board.reset()
        self.started = time.time()

    def _on_report_to_master(self, client_id, data: dict, **_) -> None:
        data[REPORT_KEY] = self.board.take()

    def _on_worker_report(self, client_id, data: dict, **_) -> None:
        self.board.merge(data.get(REPORT_KEY) or {})

    def _on_quitting(self, environment, **_) -> None:
        if self._writer is not None:
            self._writer.kill(block=True, timeout=5)
            self._write_csv()
            self._history.close()
        # Locust wrote its report before this event, under the name it expanded ({u}, {r}, {t})
        html_file = getattr(environment.parsed_options, "html_file", None)
        if html_file and os.path.exists(html_file) and not isinstance(environment.runner, WorkerRunner):
            self._append_to_html_report(html_file)

    # ---- CSV ---------------------------------------------------------------------------------------
    def _write_csv_forever(self) -> None:
        while True:
            self._write_csv()
            gevent.sleep(CSV_STATS_INTERVAL_SEC)

    def _write_csv(self) -> None:
        rows = self.rows()
        with open(f"{self.csv_prefix}_slo.csv", "w", newline="") as f:
            f.write(_csv_text(rows))
        history = csv.DictWriter(self._history, HISTORY_FIELDS)
        history.writerows({"timestamp": int(time.time()), **row} for row in rows)
        self._history.flush()

    # ---- HTML report -------------------------------------------------------------------------------
    def _append_to_html_report(self, path: str) -> None:
        with open(path, encoding="utf-8") as f:
            page = f.read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(with_section(page, _html_section(self.rows())))

    # ---- web UI ------------------------------------------------------------------------------------
    def _extend_web_ui(self, web_ui) -> None:
        """Locust's documented extension points: a tab whose table the request statistics carry
        (extended_tabs / extended_tables / extended_stats), and a CSV download."""
        web_ui.template_args["extended_tabs"] = [{"title": "SLO", "key": TAB_KEY}]
        web_ui.template_args["extended_tables"] = [
            {"key": TAB_KEY, "structure": [{"key": key, "title": TITLES[key]} for key in CSV_FIELDS]}
        ]
        web_ui.template_args["extended_csv_files"] = [{"href": "./slo/csv", "title": "Download SLO attainment CSV"}]
        web_ui.app.add_url_rule("/slo/csv", "disagg_slo_csv", self._csv_download)
        web_ui.app.after_request(self._extend_response)

    def _csv_download(self) -> Response:
        return Response(
            _csv_text(self.rows()),
            mimetype="text/csv",
            headers={"Content-Disposition": f"attachment;filename=slo_{int(time.time())}.csv"},
        )

    def _extend_response(self, response: Response) -> Response:
        if request.path.endswith("/stats/requests") and response.is_json:
            rows = [{k: _rounded(v) for k, v in row.items()} for row in self.rows()]
            extended = {"key": TAB_KEY, "data": rows}
            response.set_data(json.dumps({**response.get_json(), "extended_stats": [extended]}))
        elif request.path.endswith("/stats/report") and response.status_code == 200:
            response.set_data(with_section(response.get_data(as_text=True), _html_section(self.rows())))
        return response


def with_section(page: str, section: str) -> str:
    """`page` with `section` at the end of its body (Locust's report renders into a root element
    above it; a plain table below stays as it is)."""
    head, tag, tail = page.rpartition("</body>")
    return f"{head}{section}{tag}{tail}" if tag else page + section


def _csv_text(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _html_section(rows: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(TITLES[key])}</th>" for key in CSV_FIELDS)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(_rounded(row[key])))}</td>" for key in CSV_FIELDS) + "</tr>"
        for row in rows
    )
    return (
        '<section id="disagg-slo" style="font-family: sans-serif; margin: 2em">'
        "<h2>SLO attainment</h2>"
        "<p>Requests that met every SLO target (a failed request misses), goodput and TTFT/TPOT "
        "percentiles of the requests that succeeded, per second of the run.</p>"
        f'<table border="1" cellpadding="4" style="border-collapse: collapse"><tr>{head}</tr>{body}</table>'
        "</section>"
    )


def _rounded(value):
    return round(value, 3) if isinstance(value, float) else value
