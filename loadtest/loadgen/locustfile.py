"""Locust load test of the server's streams, with seeded real-text workloads: `GenerateUser` speaks
gRPC (`Generate`), `HttpGenerateUser` the OpenAI-compatible HTTP API (`POST /v1/chat/completions`,
streamed as server-sent events). Name a class to choose it (`locust -f loadtest/loadgen/locustfile.py
HttpGenerateUser --host http://127.0.0.1:8000`); with no class named, GenerateUser alone runs.

Every request is reported to Locust as request events (type "grpc" or "http"), so Locust's
console, CSV and HTML reports show them: "Generate TTFT", "Generate TPOT" (per request),
"Generate ITL" (per token gap), "Generate E2E" (per request; failures are reported here, with
their status code), and "Generate SLO": one per request, a failure when it missed the SLO
(Locust's failures table says which target, or the error code of a refused or failed request).
SLO attainment, goodput and TTFT/TPOT percentiles are also figures of their own (locust_slo.py):
an "SLO" tab in the web UI, PREFIX_slo.csv and PREFIX_slo_history.csv beside Locust's CSV, and a
section of the HTML report. The SLO is the server's default (read from ClusterStatus at the start;
HTTP has no call that says it, so an HTTP-only run needs the options), or --slo-ttft-ms /
--slo-tpot-ms, which are then sent with each request.
Locust rounds the times it keeps for percentiles, so each request is also written as one exact
row to --rows-csv (or $DISAGG_LOCUST_ROWS); `disagg report ROWS.csv` reads those rows.

    locust -f loadtest/loadgen/locustfile.py --headless -u 4 -r 2 -t 60s --host 127.0.0.1:50051 \\
        --csv out/locust --html out/locust.html --rows-csv out/rows.csv --workload chat

Step load: DISAGG_LOCUST_SHAPE=step enables StepLoadShape (--step-users more users every
--step-time seconds, --step-count steps; -u/-r/-t are then ignored).
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import time
import uuid
from http.client import HTTPException

from grpc.experimental import gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any channel exists: gRPC must yield to Locust's greenlets

import gevent  # noqa: E402
import grpc  # noqa: E402
from geventhttpclient import HTTPClient  # noqa: E402
from locust import LoadTestShape, User, events, task  # noqa: E402
from locust.stats import CSV_STATS_INTERVAL_SEC  # noqa: E402
from locust_slo import SloReport  # noqa: E402  (beside this file: Locust puts its folder on sys.path)

from disagg.bench.metrics import ROW_FIELDS, RequestRecord, TokenTimer, record_row, slo_misses, slo_targets  # noqa: E402
from disagg.bench.openai_stream import StreamTimer  # noqa: E402
from disagg.bench.workloads import (  # noqa: E402
    WORKLOADS,
    WorkloadConfig,
    load_tokenizer,
    make_workload,
)
from disagg.client import DisaggClient, generate_request  # noqa: E402
from disagg.slo import SLO  # noqa: E402


@events.init_command_line_parser.add_listener
def _arguments(parser) -> None:
    group = parser.add_argument_group("disagg")
    group.add_argument("--workload", choices=WORKLOADS, default="chat", help="seeded workload (disagg.bench.workloads)")
    group.add_argument("--workload-seed", type=int, default=0)
    group.add_argument("--workload-size", type=int, default=400, help="distinct prompts, used in order (then again)")
    group.add_argument("--length-scale", type=float, default=0.25, help="scales every prompt and output length")
    group.add_argument("--max-tokens", type=int, default=0, help="cap on output tokens per request (0: the workload's)")
    group.add_argument("--model", default=None, help="whose tokenizer sizes the prompts (default: the default model)")
    group.add_argument("--think-time", type=float, default=0.5, help="seconds a user waits between its requests")
    group.add_argument("--request-timeout", type=float, default=300.0)
    group.add_argument(
        "--rows-csv", default=os.environ.get("DISAGG_LOCUST_ROWS", ""), help="write one exact row per request here"
    )
    group.add_argument("--slo-ttft-ms", type=float, default=None, help="default: the server's SLO")
    group.add_argument("--slo-tpot-ms", type=float, default=None, help="default: the server's SLO")
    group.add_argument("--step-users", type=int, default=2, help="StepLoadShape: users added per step")
    group.add_argument("--step-time", type=float, default=20.0, help="StepLoadShape: seconds per step")
    group.add_argument("--step-count", type=int, default=4, help="StepLoadShape: number of steps")


class _Run:
    """What the users of one test run share: the workload, its cursor, the SLO and the rows file."""

    def __init__(self, environment):
        options = environment.parsed_options
        # Off the event loop: a worker that tokenizes for seconds there misses its heartbeats to
        # the master, which then counts it as gone (Python threads still take turns at the GIL).
        self.requests = gevent.get_hub().threadpool.apply(_workload, (options,))
        self.slo, self.request_slo = _slo(options, speaks_grpc=GenerateUser in environment.user_classes)
        self.max_tokens = options.max_tokens
        self.timeout = options.request_timeout
        self.cursor = itertools.count()
        self.csv_prefix = options.csv_prefix
        self.started = time.perf_counter()
        self.rows_file = open(options.rows_csv, "w", newline="") if options.rows_csv else None  # noqa: SIM115
        self.rows = csv.DictWriter(self.rows_file, ROW_FIELDS) if self.rows_file else None
        if self.rows:
            self.rows.writeheader()

    def next_request(self):
        index = next(self.cursor)
        req = self.requests[index % len(self.requests)]
        output_len = min(req.output_len, self.max_tokens) if self.max_tokens else req.output_len
        return index, req, output_len

    def write(self, record: RequestRecord) -> None:
        if self.rows:
            self.rows.writerow(record_row(record))
            self.rows_file.flush()

    def close(self) -> None:
        if self.rows_file:
            self.rows_file.close()
            self.rows_file = self.rows = None


def _workload(options) -> list:
    tokenizer, context = load_tokenizer(options.model)
    config = WorkloadConfig(
        options.workload, options.workload_size, options.workload_seed, context, options.length_scale
    )
    return make_workload(config, tokenizer)


_run: _Run | None = None
_slo_report: SloReport | None = None


@events.init.add_listener
def _on_init(environment, **_) -> None:
    global _slo_report
    _slo_report = SloReport(environment)
    options = environment.parsed_options
    if options and not options.user_classes and not options.class_picker:
        # Locust runs every class of the locustfile unless told which: the gRPC one stays the default
        environment.user_classes[:] = [c for c in environment.user_classes if c is not HttpGenerateUser]


@events.test_start.add_listener
def _on_test_start(environment, **_) -> None:
    global _run
    if _run is None:
        _run = _Run(environment)
    _slo_report.judge_by(_run.slo)


@events.quitting.add_listener
def _on_quitting(environment, **_) -> None:
    if _run is not None:
        _run.close()
    # A missed SLO is a measurement, not an error of the run: the exit code counts real failures.
    failed = sum(e.num_failures for e in environment.stats.entries.values() if e.name != "Generate SLO")
    environment.process_exit_code = 1 if failed else 0


@events.quit.add_listener
def _on_quit(**_) -> None:
    # Locust's CSV writer rewrites its files once a second and not again once the users have
    # stopped, so requests that ended in the last second would be missing: let it run once more.
    if _run is not None and _run.csv_prefix:
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.25)


class GenerateUser(User):
    """A closed-loop user: sends one streaming Generate, waits --think-time, repeats."""

    host = "127.0.0.1:50051"

    def wait_time(self) -> float:
        return self.environment.parsed_options.think_time

    def on_start(self) -> None:
        self.client = DisaggClient(self.host)

    def on_stop(self) -> None:
        self.client.close()

    @task
    def generate(self) -> None:
        req, output_len, record = _next_record()
        message = generate_request(
            req.prompt,
            request_id=record.request_id,
            slo=_run.request_slo,
            temperature=0.0,
            max_tokens=output_len,
            ignore_eos=True,
        )
        sent = time.perf_counter()
        record.sent_at = sent - _run.started
        timer = TokenTimer(sent)
        try:
            for msg in self.client.stream(message, timeout=_run.timeout):
                timer.on_message(len(msg.token_ids), time.perf_counter())
                record.finish_reason = msg.finish_reason or record.finish_reason
            if record.finish_reason:
                timer.finish(record, time.perf_counter())
            else:
                record.error_code, record.error = "UNKNOWN", "the stream ended without a final message"
        except grpc.RpcError as exc:
            record.error_code, record.error = exc.code().name, exc.details() or ""
        if not record.success:
            record.e2el = time.perf_counter() - sent
        _report(self.environment, "grpc", record)


def _next_record():
    """The next request of the workload, its output length, and its record (not yet sent)."""
    index, req, output_len = _run.next_request()
    record = RequestRecord(
        index=index,
        prompt_len=req.prompt_len,
        target_output_len=output_len,
        request_id=f"locust-{uuid.uuid4().hex[:12]}",
    )
    return req, output_len, record


class HttpGenerateUser(User):
    """The same closed-loop user over the OpenAI-compatible HTTP API: one streamed chat completion
    (server-sent events) per request. Not Locust's FastHttpUser: its streamed reads wait for a
    whole chunk of bytes, which would hold back a token's arrival until later ones fill it."""

    host = "http://127.0.0.1:8000"

    def wait_time(self) -> float:
        return self.environment.parsed_options.think_time

    def on_start(self) -> None:
        self.http = HTTPClient.from_url(self.host, connection_timeout=10.0, network_timeout=_run.timeout)
        self.model = _served_model(self.http)

    def on_stop(self) -> None:
        self.http.close()

    @task
    def generate(self) -> None:
        req, output_len, record = _next_record()
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": req.prompt}],
            "max_tokens": output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **({"slo": slo_targets(_run.slo)} if _run.request_slo else {}),
        }
        sent = time.perf_counter()
        record.sent_at = sent - _run.started
        try:
            with gevent.Timeout(_run.timeout, TimeoutError(f"no answer in {_run.timeout:g}s")):
                self._exchange(body, record, sent)
        except (OSError, HTTPException, ValueError, gevent.Timeout) as exc:  # no answer, or not one we can read
            record.error_code = _failure_code(exc)
            record.error = f"{type(exc).__name__}: {exc}"
            self.http.close()  # a half-read answer must not be read as the next one's
            self.http = HTTPClient.from_url(self.host, connection_timeout=10.0, network_timeout=_run.timeout)
        if not record.success:
            record.e2el = time.perf_counter() - sent
        _report(self.environment, "http", record)

    def _exchange(self, body: dict, record: RequestRecord, sent: float) -> None:
        response = self.http.post("/v1/chat/completions", json.dumps(body), headers=_JSON)
        if response.status_code != 200:
            error = json.loads(response.read() or b"{}").get("error") or {}
            record.error_code = str(error.get("code") or f"HTTP_{response.status_code}").upper()
            record.error = error.get("message", "")
            return
        stream = StreamTimer(sent)
        while line := response.readline(b"\n"):  # b"": the answer is complete
            stream.on_line(line, time.perf_counter())
        stream.finish(record, time.perf_counter())


_JSON = {"Content-Type": "application/json"}


def _failure_code(exc: BaseException) -> str:
    """A failure with no answer from the server, named as gRPC names its kind."""
    if isinstance(exc, (TimeoutError, gevent.Timeout)):
        return "DEADLINE_EXCEEDED"
    return "INVALID_RESPONSE" if isinstance(exc, ValueError) else "UNAVAILABLE"


def _served_model(http: HTTPClient) -> str:
    """The model the server names (GET /v1/models): a request must name it."""
    response = http.get("/v1/models")
    if response.status_code != 200:
        raise RuntimeError(f"GET /v1/models answered {response.status_code}: {response.read()[:200]!r}")
    return json.loads(response.read())["data"][0]["id"]


def _report(environment, api: str, record: RequestRecord) -> None:
    """The request's events (of type `api`), its SLO figures and its exact row."""
    _slo_report.add(api, record)
    _run.write(record)

    def fire(name: str, seconds: float, length: int, exception: Exception | None = None) -> None:
        environment.events.request.fire(
            request_type=api,
            name=name,
            response_time=seconds * 1e3,
            response_length=length,
            exception=exception,
            context={},
        )

    if _run.slo.any:
        misses = slo_misses(record, _run.slo)
        fire("Generate SLO", record.e2el, record.output_len, SloMissed(", ".join(misses)) if misses else None)
    if not record.success:
        fire("Generate E2E", record.e2el, 0, RuntimeError(f"{record.error_code}: {record.error}"))
        return
    fire("Generate TTFT", record.ttft, 1)
    if record.output_len > 1:
        fire("Generate TPOT", record.tpot, record.output_len - 1)
    for gap in record.itl:
        fire("Generate ITL", gap, 1)
    fire("Generate E2E", record.e2el, record.output_len)


class SloMissed(Exception):
    """A request that missed its SLO (the message says which target, or its error code)."""


def _slo(options, speaks_grpc: bool) -> tuple[SLO, SLO | None]:
    """The targets requests are judged by, and what each request sends (None: the server's)."""
    if options.slo_ttft_ms is not None or options.slo_tpot_ms is not None:
        slo = SLO(options.slo_ttft_ms or 0.0, options.slo_tpot_ms or 0.0)
        return slo, slo
    if not speaks_grpc:
        print("locustfile: no SLO events (the HTTP API does not say its SLO: give --slo-ttft-ms/--slo-tpot-ms)")
        return SLO(), None
    host = options.host or GenerateUser.host
    try:
        with DisaggClient(host) as client:
            server = client.cluster_status(timeout=10).default_slo
    except grpc.RpcError as exc:
        print(f"locustfile: no SLO events (ClusterStatus of {host}: {exc.code().name})", flush=True)
        return SLO(), None
    return SLO.of(server), None


class StepLoadShape(LoadTestShape):
    """--step-users more users every --step-time seconds for --step-count steps, then stop."""

    abstract = os.environ.get("DISAGG_LOCUST_SHAPE", "") != "step"  # only used when asked for

    def tick(self):
        options = self.runner.environment.parsed_options
        step = int(self.get_run_time() // options.step_time)
        if step >= options.step_count:
            return None
        return (step + 1) * options.step_users, max(1, options.step_users)
