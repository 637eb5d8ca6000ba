"""Prometheus metrics with vLLM's names under our `disagg:` prefix.

Every metric lives on the `CollectorRegistry` given to `ServingMetrics` (a fresh one by default,
never the process-global default registry), so two servers can run in one process.
"""

from __future__ import annotations

import hmac
import ssl
import threading
import time
from collections import deque
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from dataclasses import dataclass
from typing import Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# Milliseconds to minutes: a prefill of a short prompt up to a long generation under load.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
# One decode step: sub-millisecond on a GPU, up to seconds on a loaded CPU.
TOKEN_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

INSTANCE_LABELS = ("instance", "role")
SLO_WINDOW_S = 60.0  # what the attainment and goodput gauges cover


@dataclass
class MetricsHTTPServer:
    """A running /metrics endpoint; `stop()` shuts it down and frees the port."""

    host: str
    port: int
    _server: object
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> MetricsHTTPServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass  # a scrape every few seconds is no news


def _bearer_guard(app, api_key: str):
    """`app` for callers that send the key as `Authorization: Bearer`; 401 for the others."""
    expected = f"Bearer {api_key}".encode()

    def guarded(environ, start_response):
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
            return [b"missing or wrong API key\n"]
        return app(environ, start_response)

    return guarded


class ExpertLoad:
    """`disagg:moe_expert_tokens_total`: tokens a mixture-of-experts instance routed to each
    expert since it started, summed over its MoE layers (rank 0's: the first pipeline stage's under
    PP), as its heartbeats report them. A counter whose value the worker keeps: collected from
    the latest report rather than incremented here."""

    NAME = "disagg:moe_expert_tokens"

    def __init__(self) -> None:
        self._reports: dict[tuple[str, str], list[int]] = {}
        self._lock = threading.Lock()

    def set(self, instance: str, role: str, counts: list[int]) -> None:
        with self._lock:
            if counts:
                self._reports[(instance, role)] = list(counts)
            else:
                self._reports.pop((instance, role), None)

    def remove(self, instance: str, role: str) -> None:
        self.set(instance, role, [])

    def collect(self):
        family = CounterMetricFamily(
            self.NAME, "Tokens routed to each expert of a mixture of experts, summed over its MoE layers.",
            labels=("instance", "role", "expert"),
        )  # fmt: skip
        with self._lock:
            reports = dict(self._reports)
        for (instance, role), counts in sorted(reports.items()):
            for expert, count in enumerate(counts):
                family.add_metric((instance, role, str(expert)), count)
        yield family


class KVTierLoad:
    """The KV tiers under each instance's pool and the cluster-wide prefix index, from the
    instances' reports (flat, as `disagg status` shows them: router.kv_tier_status):
    `disagg:kv_tier_hit_blocks_total` and `disagg:kv_tier_loaded_bytes_total` by tier (counters
    the worker keeps), `disagg:kv_tier_held_bytes` by tier, `disagg:kv_index_entries` (blocks the
    index lists for it) and `disagg:kv_index_lag_seconds` (its publisher's latest batch); and on a
    prefill instance `disagg:kv_peer_fetched_blocks_total` and `disagg:kv_peer_fetched_bytes_total`
    (blocks it fetched from peers instead of computing them: disagg.kv_transfer.peer_blocks)."""

    COUNTERS = {"hit_blocks": "disagg:kv_tier_hit_blocks", "loaded_bytes": "disagg:kv_tier_loaded_bytes"}
    GAUGES = {"held_bytes": "disagg:kv_tier_held_bytes"}
    SCALARS = {"index.entries": "disagg:kv_index_entries", "index.lag_s": "disagg:kv_index_lag_seconds"}
    PEER_COUNTERS = {
        "peer.fetched_blocks": "disagg:kv_peer_fetched_blocks",
        "peer.fetched_bytes": "disagg:kv_peer_fetched_bytes",
    }

    def __init__(self) -> None:
        self._reports: dict[tuple[str, str], dict[str, float]] = {}
        self._lock = threading.Lock()

    def set(self, instance: str, role: str, flat: dict[str, float]) -> None:
        with self._lock:
            if flat:
                self._reports[(instance, role)] = dict(flat)
            else:
                self._reports.pop((instance, role), None)

    def remove(self, instance: str, role: str) -> None:
        self.set(instance, role, {})

    def collect(self):
        with self._lock:
            reports = dict(self._reports)
        for key, name in self.COUNTERS.items():
            yield self._by_tier(CounterMetricFamily(name, f"KV tier {key} by tier.", labels=_TIER_LABELS), key, reports)
        for key, name in self.GAUGES.items():
            yield self._by_tier(GaugeMetricFamily(name, f"KV tier {key} by tier.", labels=_TIER_LABELS), key, reports)
        for key, name in self.SCALARS.items():
            yield self._by_instance(
                GaugeMetricFamily(name, f"Prefix index: {key}.", labels=_INSTANCE_LABELS), key, reports
            )
        for key, name in self.PEER_COUNTERS.items():
            family = CounterMetricFamily(name, f"KV blocks fetched from peers: {key}.", labels=_INSTANCE_LABELS)
            yield self._by_instance(family, key, reports)

    @staticmethod
    def _by_instance(family, key: str, reports: dict):
        for (instance, role), flat in sorted(reports.items()):
            if key in flat:
                family.add_metric((instance, role), flat[key])
        return family

    @staticmethod
    def _by_tier(family, key: str, reports: dict):
        for (instance, role), flat in sorted(reports.items()):
            for name, value in sorted(flat.items()):
                if name.startswith(f"{key}."):
                    family.add_metric((instance, role, name.split(".", 1)[1]), value)
        return family


_TIER_LABELS = ("instance", "role", "tier")
_INSTANCE_LABELS = ("instance", "role")


REPLAN_PREFIX = "disagg:replan_"


class MirroredFamilies:
    """Metric families another process keeps (the controller's re-planning ones), as its last
    snapshot (`ServingMetrics.replan_families`): a frontend exposes them on its own endpoint, so
    that the controller, an actor anywhere in the cluster, needs no port of its own. Every
    frontend shows the same values: aggregate them with max, not sum."""

    def __init__(self):
        self._families: list[dict] = []

    def set(self, families: list[dict]) -> None:
        self._families = list(families)

    def collect(self):
        for family in self._families:
            metric = Metric(family["name"], family["documentation"], family["type"])
            for name, labels, value in family["samples"]:
                metric.add_sample(name, labels, value)
            yield metric


class ServingMetrics:
    """The serving metrics of one frontend (request latencies, KV transfers, instance load) and
    of the re-planning loop, where it runs (`replan=False`: a frontend's under a controller,
    which mirrors the controller's re-planning families instead)."""

    def __init__(self, registry: CollectorRegistry | None = None, replan: bool = True):
        self.registry = registry if registry is not None else CollectorRegistry()
        self._define_request_metrics()
        self._define_transfer_metrics()
        self._define_instance_gauges()
        self.expert_load = ExpertLoad()
        self.registry.register(self.expert_load)
        self.kv_tiers = KVTierLoad()
        self.registry.register(self.kv_tiers)
        self._define_control_metrics()
        self.controller_metrics = MirroredFamilies()
        if replan:
            self._define_replan_metrics()
        else:  # the loop runs in the controller: its families, as last fetched
            self.registry.register(self.controller_metrics)
        self._define_slo_metrics()

    def _histogram(self, name: str, doc: str, buckets: Iterable[float] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(name, doc, buckets=tuple(buckets), registry=self.registry)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        # prometheus_client appends `_total` to a counter's name when it renders it.
        return Counter(name.removesuffix("_total"), doc, labelnames=labels, registry=self.registry)

    def _define_request_metrics(self) -> None:
        h, c = self._histogram, self._counter
        self.time_to_first_token = h("disagg:time_to_first_token_seconds", "Arrival to first token at the frontend.")
        self.inter_token_latency = h(
            "disagg:inter_token_latency_seconds", "Time between consecutive output tokens.", TOKEN_LATENCY_BUCKETS
        )
        self.e2e_request_latency = h("disagg:e2e_request_latency_seconds", "Arrival to last token.")
        self.request_queue_time = h("disagg:request_queue_time_seconds", "Arrival until the prefill starts.")
        self.request_prefill_time = h("disagg:request_prefill_time_seconds", "Prefill compute until the first token.")
        self.request_decode_time = h("disagg:request_decode_time_seconds", "First token to last token.")
        self.request_success = c("disagg:request_success_total", "Finished requests.", ("finish_reason",))
        self.request_failure = c("disagg:request_failure_total", "Failed requests by gRPC status code.", ("code",))
        self.request_migrations = c(
            "disagg:request_migrations_total", "Requests moved on after an instance failed under them.", ("cause",)
        )
        self.live_moves = c(
            "disagg:live_moves_total", "Decoding requests moved to another instance with their KV.", ("outcome",)
        )
        self.prompt_tokens = c("disagg:prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = c("disagg:generation_tokens_total", "Generated tokens of finished requests.")

    def _define_transfer_metrics(self) -> None:
        self.kv_transfer_time = self._histogram("disagg:kv_transfer_seconds", "KV-cache transfer time per request.")
        self.kv_transfer_bytes = self._counter("disagg:kv_transfer_bytes_total", "KV-cache bytes transferred.")
        self.kv_prefill_saved = self._counter(
            "disagg:kv_prefill_saved_seconds_total",
            "Prefill time the prompt tokens found cached (in the pool, a lower tier, or fetched from a peer) "
            "would have cost, by the prefill instance's fitted model: the TTFT that KV reuse saved.",
        )

    def _define_instance_gauges(self) -> None:
        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames=INSTANCE_LABELS, registry=self.registry)

        self.kv_cache_usage = gauge("disagg:kv_cache_usage_perc", "KV-cache usage, 0..1 (1 = 100 percent).")
        self.num_requests_running = gauge("disagg:num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("disagg:num_requests_waiting", "Requests waiting (incl. for KV).")
        self.latency_model_error = gauge(
            "disagg:latency_model_error_ratio",
            "Median relative error of the router's step-time predictions for the instance (its last steps).",
        )

    def _define_slo_metrics(self) -> None:
        self.slo_requests = self._counter(
            "disagg:slo_requests_total",
            "Requests by SLO class (their priority) and whether they met both their TTFT and TPOT targets "
            "(one refused or failed after it was read did not).",
            ("slo_class", "met"),
        )
        window = f"the last {SLO_WINDOW_S:.0f} s"
        self.slo_attainment = Gauge(
            "disagg:slo_attainment_ratio", f"Share of {window}'s requests that met both SLO targets, per SLO class.",
            labelnames=("slo_class",), registry=self.registry,
        )  # fmt: skip
        self.goodput = Gauge(
            "disagg:goodput_requests_per_second", f"Requests a second meeting both SLO targets over {window}, per SLO class.",
            labelnames=("slo_class",), registry=self.registry,
        )  # fmt: skip
        self._slo_window: deque[tuple[float, str, bool]] = deque(maxlen=100_000)
        self._slo_classes: set[str] = set()

    def _define_replan_metrics(self) -> None:
        self.replan_decisions = self._counter(
            "disagg:replan_decisions_total", "Re-planning decisions, by whether they asked for a switch.", ("switch",)
        )
        self.replan_predicted_gain = Gauge(
            "disagg:replan_predicted_gain_points",
            "The best split's predicted SLO attainment over the current split's, at the last decision.",
            registry=self.registry,
        )
        self.replan_switches = self._counter(
            "disagg:replan_switches_total", "Instances switched between prefill and decode.", ("outcome",)
        )
        self.replan_switch_time = self._histogram(
            "disagg:replan_switch_seconds", "From a switch's decision to the instance serving in its new role."
        )
        self.replan_predicted_goodput = Gauge(
            "disagg:replan_predicted_goodput",
            "Requests/s meeting their SLO that the last checked switch was predicted to give.",
            registry=self.registry,
        )
        self.replan_measured_goodput = Gauge(
            "disagg:replan_measured_goodput",
            "Requests/s meeting their SLO measured in the window after the last checked switch.",
            registry=self.registry,
        )
        self.replan_scale = self._counter(
            "disagg:replan_scale_total",
            "Instances the re-planner added (direction up) or removed (down), by outcome (done, failed).",
            ("direction", "outcome"),
        )
        self.replan_checks = self._counter(
            "disagg:replan_checks_total",
            "Switches checked against the window after them, by outcome (kept, undone, unmeasured).",
            ("outcome",),
        )

    def _define_control_metrics(self) -> None:
        self.control_loop_failures = self._counter(
            "disagg:control_loop_failures_total",
            "Control loops (re-planning, rebalancing, drains, health, gauges, relaunch supervision) that "
            "raised or returned and were started again (disagg.supervision).",
            ("loop",),
        )
        self.pool_size = Gauge(
            "disagg:pool_instances", "Instances in placement, per pool.", labelnames=("role",), registry=self.registry
        )

    def replan_families(self) -> list[dict]:
        """The re-planning families as plain data (what `MirroredFamilies` shows elsewhere)."""
        return [
            {"name": f.name, "documentation": f.documentation, "type": f.type,
             "samples": [(s.name, dict(s.labels), s.value) for s in f.samples if not s.name.endswith("_created")]}
            for f in self.registry.collect() if f.name.startswith(REPLAN_PREFIX)
        ]  # fmt: skip

    # -- observations -------------------------------------------------------------------------------
    def observe_replan(self, switch: bool, gain_points: float) -> None:
        self.replan_decisions.labels(switch=str(switch).lower()).inc()
        self.replan_predicted_gain.set(gain_points)

    def observe_replan_check(self, outcome: str, predicted_goodput: float, measured_goodput: float | None) -> None:
        """A switch checked: what it was predicted to give and what the window after it measured
        (None: too little was judged to tell; the gauges keep the last measured check's)."""
        self.replan_checks.labels(outcome=outcome).inc()
        if measured_goodput is not None:
            self.replan_predicted_goodput.set(predicted_goodput)
            self.replan_measured_goodput.set(measured_goodput)

    def slo_outcomes(self, since: float, until: float) -> tuple[int, int]:
        """(met, judged) of the requests judged between `since` and `until` (time.monotonic(),
        within the last SLO_WINDOW_S)."""
        verdicts = [met for at, _, met in self._slo_window if since <= at <= until]
        return sum(verdicts), len(verdicts)

    def control_loop_failed(self, loop: str) -> None:
        """A control loop ended and is started again (disagg.supervision's on_failure)."""
        self.control_loop_failures.labels(loop=loop).inc()

    def observe_scale(self, direction: str, outcome: str) -> None:
        """A scale step: `direction` up (added) or down (removed), `outcome` done or failed."""
        self.replan_scale.labels(direction=direction, outcome=outcome).inc()

    def observe_switch(self, outcome: str, seconds: float) -> None:
        """`outcome`: "done" (serving in the new role) or "failed" (back in its old role)."""
        self.replan_switches.labels(outcome=outcome).inc()
        if outcome == "done":
            self.replan_switch_time.observe(seconds)

    def observe_finished(
        self,
        ttft_s: float,
        e2e_s: float,
        itl_s: list[float],
        queue_s: float,
        prefill_s: float,
        decode_s: float,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str,
    ) -> None:
        """Record one request that finished (stop, length or abort) with its per-phase timings."""
        self.time_to_first_token.observe(ttft_s)
        self.e2e_request_latency.observe(e2e_s)
        for gap_s in itl_s:
            self.inter_token_latency.observe(gap_s)
        self.request_queue_time.observe(queue_s)
        self.request_prefill_time.observe(prefill_s)
        self.request_decode_time.observe(decode_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.request_success.labels(finish_reason=finish_reason).inc()

    def observe_slo(self, slo_class: str, met: bool, now: float | None = None) -> None:
        """A request judged against its SLO (its priority names its class)."""
        self.slo_requests.labels(slo_class=slo_class, met=str(met).lower()).inc()
        self._slo_window.append((time.monotonic() if now is None else now, slo_class, met))
        self.refresh_slo_window(now)

    def refresh_slo_window(self, now: float | None = None) -> None:
        """The attainment and goodput gauges over the last SLO_WINDOW_S (also as it empties)."""
        now = time.monotonic() if now is None else now
        while self._slo_window and self._slo_window[0][0] < now - SLO_WINDOW_S:
            self._slo_window.popleft()
        judged: dict[str, list[bool]] = {}
        for _, slo_class, met in self._slo_window:
            judged.setdefault(slo_class, []).append(met)
        self._slo_classes |= set(judged)
        for slo_class in self._slo_classes:  # (a class seen before, now quiet, shows an empty window)
            verdicts = judged.get(slo_class, [])
            self.slo_attainment.labels(slo_class=slo_class).set(sum(verdicts) / len(verdicts) if verdicts else 1.0)
            self.goodput.labels(slo_class=slo_class).set(sum(verdicts) / SLO_WINDOW_S)

    def observe_transfer(self, seconds: float, num_bytes: int) -> None:
        self.kv_transfer_time.observe(seconds)
        self.kv_transfer_bytes.inc(num_bytes)

    def observe_prefill_saved(self, seconds: float) -> None:
        """A request placed with cached prompt tokens: the prefill time they would have cost."""
        self.kv_prefill_saved.inc(max(0.0, seconds))

    def observe_migration(self, cause: str) -> None:
        """A request continued on other instances; `cause` names the failure (e.g. "WorkerLinkError")."""
        self.request_migrations.labels(cause=cause).inc()

    def observe_live_moves(self, moved: int, failed: int) -> None:
        """A drain's moves: `moved` went on elsewhere with their KV, `failed` stayed where they were."""
        self.live_moves.labels(outcome="moved").inc(moved)
        self.live_moves.labels(outcome="failed").inc(failed)

    def observe_failure(self, code: str) -> None:
        """A request that ended in an error; `code` is the gRPC status name (e.g. "UNAVAILABLE")."""
        self.request_failure.labels(code=code).inc()

    def set_instance_load(self, instance: str, role: str, running: int, waiting: int, kv_usage: float) -> None:
        self.num_requests_running.labels(instance=instance, role=role).set(running)
        self.num_requests_waiting.labels(instance=instance, role=role).set(waiting)
        self.kv_cache_usage.labels(instance=instance, role=role).set(kv_usage)

    def set_expert_load(self, instance: str, role: str, counts: list[int]) -> None:
        """A mixture of experts' per-expert load from the instance's report ([]: a dense model)."""
        self.expert_load.set(instance, role, counts)

    def set_model_error(self, instance: str, role: str, error: float) -> None:
        self.latency_model_error.labels(instance=instance, role=role).set(error)

    def remove_instance(self, instance: str, role: str) -> None:
        """Drop an instance's series (it left the cluster), so dashboards don't show a stale value."""
        self.expert_load.remove(instance, role)
        self.kv_tiers.remove(instance, role)
        for gauge in (
            self.num_requests_running,
            self.num_requests_waiting,
            self.kv_cache_usage,
            self.latency_model_error,
        ):
            try:
                gauge.remove(instance, role)
            except KeyError:
                pass

    # -- exposition -----------------------------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric here."""
        return prometheus_client.generate_latest(self.registry)

    def start_http_server(
        self,
        port: int,
        host: str = "127.0.0.1",
        api_key: str | None = None,
        tls: tuple[str, str] | None = None,
        client_ca: str | None = None,
    ) -> MetricsHTTPServer:
        """Serve /metrics on a daemon thread; `port=0` picks a free port (see `.port`). With
        `api_key`, a scrape must send `Authorization: Bearer <key>` (401 otherwise); with `tls`
        (cert file, key file), it is HTTPS; with `client_ca` too, a scraper must present a
        certificate that CA signed."""
        app = prometheus_client.make_wsgi_app(self.registry)
        if api_key:
            app = _bearer_guard(app, api_key)
        server = make_server(host, port, app, _ThreadingWSGIServer, handler_class=_QuietHandler)
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(certfile=tls[0], keyfile=tls[1])
            if client_ca:
                context.verify_mode = ssl.CERT_REQUIRED
                context.load_verify_locations(cafile=client_ca)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        return MetricsHTTPServer(host=host, port=server.server_port, _server=server, scheme="https" if tls else "http")
