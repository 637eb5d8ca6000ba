"""The simulator runs the re-planner (disagg.planner.replan_sim): on a workload that shifts from
prefill-heavy to decode-heavy and back, it moves instances toward each phase's side, does not
oscillate, and serves more than the split it started from; `disagg simulate --replan` says so."""

from __future__ import annotations

import json
import random

import pytest

from disagg.cli import main as disagg_main
from disagg.config import ServingConfig
from disagg.placement.profile import load_profile
from disagg.planner.deployment import Deployment
from disagg.planner.replan_sim import goodput, simulate_replanning
from disagg.planner.workload import SimRequest

PROFILE = "deploy/profiles/smollm2-135m-cpu-1t.json"
TTFT_MS, TPOT_MS = 1500.0, 120.0
CONFIG = {
    "mode": "disaggregated",
    "engine": {"num_kv_blocks": 2048, "max_num_batched_tokens": 512},
    "prefill": {"num_instances": 2},
    "decode": {"num_instances": 2},
    "slo": {"ttft_ms": TTFT_MS, "tpot_ms": TPOT_MS},
}
PREFILL_HEAVY = dict(rate=1.5, prompt=(700, 900), output=(4, 8))
DECODE_HEAVY = dict(rate=8.0, prompt=(20, 40), output=(150, 200))


def shifting_requests(seconds: float = 60.0) -> list[SimRequest]:
    rng, requests, start = random.Random(0), [], 0.0
    for phase in (PREFILL_HEAVY, DECODE_HEAVY, PREFILL_HEAVY):
        t = start
        while t < start + seconds:
            requests.append(SimRequest(len(requests), t, rng.randint(*phase["prompt"]), rng.randint(*phase["output"])))
            t += rng.expovariate(phase["rate"])
        start += seconds
    return requests


@pytest.fixture(scope="module")
def setup():
    profile = load_profile(PROFILE)
    return ServingConfig.from_dict(CONFIG), {"prefill": profile, "decode": profile}, shifting_requests()


def test_replanning_follows_the_shift_without_oscillating(setup):
    config, profiles, requests = setup
    run = simulate_replanning(config, profiles, requests, interval_s=5.0, window_s=15.0, hold_s=10.0)
    # Each phase's switches go its way (decided after its first seconds, within its span).
    phase_of = {0: "prefill", 1: "decode", 2: "prefill"}
    assert run.switches, "no switch at all"
    assert all(s.to_role == phase_of[int(s.decided_s // 60)] for s in run.switches), run.switches
    assert len(run.switches) <= 6, run.switches  # a few per phase change at most: no back and forth
    static = Deployment(config, profiles).simulator().run(requests)
    duration = max(r.arrival_s for r in requests)
    assert goodput(run.records, config.slo, duration) > goodput(static, config.slo, duration)


def test_disagg_simulate_replan_reports_the_gain(setup, tmp_path, capsys):
    _, _, requests = setup
    trace = tmp_path / "shift.json"
    rows = [{"arrival_s": r.arrival_s, "prompt_len": r.prompt_len, "output_len": r.output_len} for r in requests]
    trace.write_text(json.dumps({"requests": rows}))
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(CONFIG))  # JSON is YAML
    code = disagg_main(["simulate", "--trace", str(trace), "--config", str(config), "--profile", PROFILE, "--replan"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line and not line.startswith("switch"))
    assert float(lines["replan goodput"]) > float(lines["static 2P:2D goodput"])
    ratio = float(lines["replan goodput ratio"])
    assert ratio == pytest.approx(float(lines["replan goodput"]) / float(lines["best static goodput"]), rel=1e-3)
