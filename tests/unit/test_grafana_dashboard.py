"""The Grafana dashboard (deploy/grafana/) names only metrics the server's /metrics serves, and
shows what operators look for; its Prometheus scrape config points at /metrics (pure: the
metrics' own HTTP endpoint, no server)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import yaml

from disagg.metrics import ServingMetrics

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
TOPICS = ("attainment", "goodput", "first token", "per output token", "refused", "queue", "kv cache",
          "kv transfers", "migrations", "latency-model error", "plan")  # fmt: skip


def exposition_names(text: str) -> set[str]:
    """Every series name /metrics can show: a histogram's _bucket, _sum and _count too."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE):
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((GRAFANA / "disagg-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_metric_the_dashboard_names_is_served_on_metrics():
    server = ServingMetrics().start_http_server(0)
    try:
        text = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
    finally:
        server.stop()
    served = exposition_names(text)
    named = {name for expr in dashboard_exprs() for name in re.findall(r"disagg:[a-z_]+", expr)}
    assert named, "the dashboard names no metric"
    assert named <= served, f"named by the dashboard, not served: {sorted(named - served)}"


def test_the_dashboard_shows_what_operators_look_for():
    dashboard = json.loads((GRAFANA / "disagg-dashboard.json").read_text())
    titles = " | ".join(panel["title"].lower() for panel in dashboard["panels"])
    assert [t for t in TOPICS if t not in titles] == []
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_scrape_config_reads_metrics():
    config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]


def test_the_scrape_config_scrapes_every_frontend_with_the_key_from_a_file():
    """/metrics asks for the API key wherever one is set: the scraper sends it as a bearer token
    read from a file (no key in the repository), to frontend i at metrics_port + i."""
    (job,) = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())["scrape_configs"]
    assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]
    assert "credentials" not in job["authorization"]
    ports = [int(target.rsplit(":", 1)[1]) for target in job["static_configs"][0]["targets"]]
    assert len(ports) >= 2 and ports == list(range(ports[0], ports[0] + len(ports)))
