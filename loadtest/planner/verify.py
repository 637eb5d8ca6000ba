"""The planner's choice for this machine's 2 cores, against real servers.

    .venv/bin/python -m loadtest.planner.verify [--out DIR] [--workloads prefill-heavy]
    .venv/bin/python -m loadtest.planner.verify --reuse DIR    # re-plan, no servers
    .venv/bin/python -m loadtest.planner.verify --smoke [--config C]   # the smallest run

0. profile this host first (`disagg profile` at 1 and 2 threads, then
   `loadtest.host.sharing` for the 1-thread one), into OUT/profiles/: this machine's CPU model
   is not fixed from one day to the next (AVX-512 or AVX2), so a plan checked against real servers
   must come from profiles of the same host measured in the same run (kept in OUT/profiles/ for
   the next run; `--profile-1t/--profile-2t` name others).

For each workload (one prefill-heavy, one decode-heavy) and its SLO:
1. plan: the search (`disagg plan`'s) for what 2 cores can host, in both views the CPU profiles
   give: `cpu-1t` (2 devices of 1 thread: disaggregated 1P+1D, colocated x2, ...) and `cpu-2t`
   (1 device of 2 threads: colocated chunked or prefill-first). Every candidate is replicated over
   the host and simulated whole (`disagg.planner.host_plan`: instances on one host share its
   cores), and the one with the highest rate is the pick, with its predicted rate;
2. measure: each mode worth comparing (the pick, the best disaggregated, the best colocated
   chunked and prefill-first at 2 threads) served as the config `disagg plan -o` writes for it
   (`plan_config.serving_config_dict`, the workload's SLO in it), swept over rates around its
   prediction by `disagg.bench.experiment` (enough requests per rate that the arrivals last
   `SUSTAINED_S`: the planner requires its SLO over each run's last third too), and the rate
   where attainment crosses 90% interpolated (`attainment_crossing`);
3. print per workload: the pick and its predicted rate, each mode's measured 90% rate, whether
   the pick is the measured winner, and each prediction's error (target: within 10%).

Measured runs are saved under OUT/<workload>/<mode>/ (the experiment's own layout) beside
OUT/<workload>/plan.json; a mode whose runs are there is not measured again (delete its directory
to re-measure it); `--reuse OUT` plans again and reads them instead of running servers.
`--smoke`: the same steps at the smallest sizes (a short plan, the pick alone at its predicted
rate with a few requests): a check that it runs, not figures.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from disagg.bench.launcher import add_config_argument, read_config
from disagg.bench.metrics import RequestRecord, attainment_crossing, summarize
from disagg.bench.results import host_line
from disagg.config import merge_settings
from disagg.placement.profile import load_profile
from disagg.planner.hardware import hardware_spec
from disagg.planner.host_plan import HostPlan, host_plans
from disagg.planner.models import model_spec
from disagg.planner.plan_config import serving_config_dict
from disagg.planner.search import NodeKind, Search
from disagg.planner.workload import SimRequest
from disagg.slo import SLO, parse_slo

MODEL = "smollm2-135m-instruct"
HOST_CPUS = 2
SUSTAINED_S = 60.0  # arrivals per rate: several times the longest request, so a queue that grows shows
MIN_REQUESTS = 30
RATE_STEPS = (0.8, 1.0, 1.2)  # x the predicted rate: brackets a prediction within +-20%
PLAN_REQUESTS = 300
TARGET_ERROR = 0.10


@dataclass(frozen=True)
class Effort:
    """How much is planned and measured: the planner's requests, rate tolerance and simulated
    seconds per rate, the rates swept around a prediction and how long each lasts, and which modes
    are measured (None: all)."""

    plan_requests: int = PLAN_REQUESTS
    rate_tolerance: float = 0.02
    plan_duration_s: float = 90.0  # the search's own default
    rate_steps: tuple[float, ...] = RATE_STEPS
    sustained_s: float = SUSTAINED_S
    min_requests: int = MIN_REQUESTS
    num_unloaded: int = 2
    modes: tuple[str, ...] | None = None


FULL = Effort()
SMOKE = Effort(  # every step runs, nothing is measured
    plan_requests=20,
    rate_tolerance=0.5,
    plan_duration_s=5.0,
    rate_steps=(1.0,),
    sustained_s=0.0,
    min_requests=2,
    modes=("pick",),
)


@dataclass(frozen=True)
class VerifyWorkload:
    name: str  # disagg.bench.workloads
    slo: str
    why: str  # why this SLO suits it
    length_scale: float = 1.0
    input_len: int = 256  # fixed only
    output_len: int = 64

    def config(self, num_requests: int, seed: int, context: int):
        from disagg.bench.workloads import WorkloadConfig

        return WorkloadConfig(
            self.name, num_requests, seed, context, self.length_scale, self.input_len, self.output_len
        )


WORKLOADS = {
    "prefill-heavy": VerifyWorkload(
        "summarization",
        "ttft_ms=3000,tpot_ms=300",
        "prompts 102-325 tokens, outputs 13-38: TTFT binds (a 1-thread prefill of a mean prompt takes 0.5-1 s, "
        "by host; 3 s leaves room for a short queue); TPOT 300 ms is 3x a 1-thread decode step",
        length_scale=0.2,
    ),
    "decode-heavy": VerifyWorkload(
        "fixed",
        "ttft_ms=1500,tpot_ms=200",
        "64-token prompts, 128-token outputs: TPOT binds (about 2x a 1-thread decode step of one request, "
        "so a batch may grow to ~16, and prompt chunks stalling decodes count); TTFT 1.5 s is 4x an unloaded prefill",
        input_len=64,
        output_len=128,
    ),
}


# ---- 0. profile -----------------------------------------------------------------------------------
def profile_host(out: Path) -> tuple[str, str]:
    """This host's 1- and 2-thread profiles (the 1-thread one with its host sharing), in out."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {threads: out / f"smollm2-135m-cpu-{threads}t.json" for threads in (1, 2)}
    for threads, path in paths.items():
        if not path.exists():
            print(f"  profiling at {threads} thread(s) -> {path}", flush=True)
            _run(["-m", "disagg.cli", "profile", "--threads", str(threads), "--tp-pp", "1x1", "-o", str(path)])
    if not json.loads(paths[1].read_text()).get("host_sharing"):  # a profile writes {} until measured
        print("  measuring host sharing (two 1-thread engines side by side)", flush=True)
        _run(["-m", "loadtest.host.sharing", "--threads", "1", "--write-profile", str(paths[1])])
    return str(paths[1]), str(paths[2])


def _run(args: list[str]) -> None:
    subprocess.run([sys.executable, *args], check=True)


# ---- 1. plan --------------------------------------------------------------------------------------
def plan(
    workload: VerifyWorkload, profile_1t: str, profile_2t: str, seed: int = 0, effort: Effort = FULL
) -> list[HostPlan]:
    """Every candidate of both views of the host, filled and simulated whole, best first."""
    config = model_spec(MODEL)
    slo = parse_slo(workload.slo)
    requests = lengths(workload, config.max_position_embeddings, seed, effort.plan_requests)
    searched = []
    for path, devices in ((profile_1t, HOST_CPUS), (profile_2t, 1)):
        profile = load_profile(path, model=MODEL)
        kind = NodeKind(hardware_spec(profile.hardware), profile, 1, devices)
        search = Search(
            config, [kind], requests, slo, max_model_len=config.max_position_embeddings, seed=seed,
            rate_tolerance=effort.rate_tolerance, min_duration_s=effort.plan_duration_s,
        )  # fmt: skip
        searched.append((search, search.run()))
    return host_plans(searched)


def lengths(workload: VerifyWorkload, context: int, seed: int, num: int = PLAN_REQUESTS) -> list[SimRequest]:
    from disagg.bench.workloads import sample_lengths

    prompts, outputs = sample_lengths(workload.config(num, seed, context))
    return [SimRequest(i, 0.0, int(p), int(o)) for i, (p, o) in enumerate(zip(prompts, outputs))]


def modes_to_measure(plans: list[HostPlan], only: tuple[str, ...] | None = None) -> dict[str, HostPlan]:
    """The pick, and the best of each mode it is compared with (a mode the pick is, once);
    `only`: those of these names."""
    wanted = {
        "pick": lambda p: True,
        "disaggregated": lambda p: p.candidate.mode == "disaggregated",
        "colocated-chunked-2t": lambda p: _colocated(p, "chunked") and p.hardware.endswith("-2t"),
        "colocated-prefill-first-2t": lambda p: _colocated(p, "prefill_first") and p.hardware.endswith("-2t"),
    }
    chosen: dict[str, HostPlan] = {}
    for name, accepts in wanted.items():
        best = next((p for p in plans if accepts(p)), None)
        if best is not None and all(best is not other for other in chosen.values()):
            chosen[name] = best
    return {name: p for name, p in chosen.items() if only is None or name in only}


def _colocated(plan: HostPlan, policy: str) -> bool:
    return plan.candidate.mode == "colocated" and plan.candidate.pools["colocated"].scheduling_policy == policy


def config_for(plan: HostPlan, workload: VerifyWorkload, base_config: str | None = None) -> dict:
    """The serving config `disagg plan -o` writes for the candidate, on this host's Ray, laid over
    `base_config` (a serving config file; None: the defaults)."""
    kinds = plan.search.kinds
    return merge_settings(
        read_config(base_config), serving_config_dict(plan.candidate, MODEL, parse_slo(workload.slo), kinds)
    )


def sweep(predicted_rate: float, effort: Effort = FULL) -> tuple[tuple[float, ...], int]:
    """Rates around the prediction, and requests per rate for `SUSTAINED_S` of arrivals at it."""
    rates = tuple(round(predicted_rate * step, 3) for step in effort.rate_steps)
    return rates, max(effort.min_requests, math.ceil(predicted_rate * effort.sustained_s))


# ---- 2. measure --------------------------------------------------------------------------------------
def measure(
    name: str, plan: HostPlan, workload: VerifyWorkload, out: Path, seed: int = 0, effort: Effort = FULL,
    base_config: str | None = None,
) -> Path:  # fmt: skip
    """Sweep one mode's config on a real server; the experiment's directory."""
    from disagg.bench.experiment import ExperimentConfig, run_experiment, workload_size
    from disagg.bench.workloads import describe, load_tokenizer, make_workload

    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "plan-config.yaml"
    config_path.write_text(yaml.safe_dump(config_for(plan, workload, base_config), sort_keys=False))
    rates, num_requests = sweep(plan.rate, effort)
    exp = ExperimentConfig(
        rates,
        num_requests,
        str(out),
        (name,),
        slo=parse_slo(workload.slo),
        num_unloaded=effort.num_unloaded,
        seed=seed,
        config_files={name: str(config_path)},
    )
    tokenizer, context = load_tokenizer(None)
    wl = workload.config(workload_size(exp), seed, context)
    requests = make_workload(wl, tokenizer)
    run_experiment(exp, requests, describe(wl, requests), log=lambda line: print(f"    {line}", flush=True))
    return out


def measured_points(out: Path, name: str, slo: SLO) -> list[tuple[float, float]]:
    """(rate, attainment %) of each saved run of the mode, under the workload's SLO."""
    points = []
    for path in sorted(out.glob(f"runs/{name}_rate*.json")):
        data = json.loads(path.read_text())
        records = [RequestRecord.from_dict(r) for r in data["requests"]]
        summary = summarize(records, data["summary"]["duration_s"], slo)
        points.append((float(data["load"]["request_rate"]), summary["slo_attainment_pct"]))
    return sorted(points)


def measured_rate(points: list[tuple[float, float]]) -> float | None:
    """The measured 90% rate: the crossing, or None where the sweep does not bracket it."""
    return attainment_crossing(points)["crossing"]


# ---- 3. report -----------------------------------------------------------------------------------------
def verdict(chosen: dict[str, HostPlan], measured: dict[str, float | None]) -> dict:
    """Whether the pick is the measured winner, and each prediction's relative error."""
    rates = {name: rate for name, rate in measured.items() if rate is not None}
    winner = max(rates, key=rates.get) if rates else None
    errors = {
        name: (plan.rate - measured[name]) / measured[name] if measured.get(name) else None
        for name, plan in chosen.items()
    }
    pick_error = errors.get("pick")
    return {
        "measured_winner": winner,
        "pick_is_winner": winner == "pick",
        "errors": errors,
        "pick_within_10pct": pick_error is not None and abs(pick_error) <= TARGET_ERROR,
    }


def run(
    out: Path, workloads: list[str], profile_1t: str, profile_2t: str, reuse: bool, seed: int = 0,
    effort: Effort = FULL, base_config: str | None = None,
) -> dict:  # fmt: skip
    results = {}
    for key in workloads:
        workload = WORKLOADS[key]
        print(f"\n== {key}: {workload.name}, SLO {workload.slo} ({workload.why})", flush=True)
        plans = plan(workload, profile_1t, profile_2t, seed, effort)
        chosen = modes_to_measure(plans, effort.modes)
        print_plans(plans)
        slo = parse_slo(workload.slo)
        measured = {}
        for name, host_plan in chosen.items():
            mode_dir = out / key / name
            if not reuse and not any(mode_dir.glob("runs/*.json")):  # a mode measured before is kept
                rates, n = sweep(host_plan.rate, effort)
                print(f"  measuring {name} ({host_plan.label}) at {rates} req/s, {n} requests each", flush=True)
                measure(name, host_plan, workload, mode_dir, seed, effort, base_config)
            points = measured_points(mode_dir, name, slo)
            measured[name] = measured_rate(points)
            print(f"  {name}: measured {points}", flush=True)
        results[key] = summary(key, workload, chosen, measured)
        (out / key).mkdir(parents=True, exist_ok=True)
        (out / key / "plan.json").write_text(json.dumps(results[key], indent=1) + "\n")
        print_verdict(results[key])
    return results


def summary(key: str, workload: VerifyWorkload, chosen: dict[str, HostPlan], measured: dict) -> dict:
    return {
        "workload": key,
        "spec": {"name": workload.name, "slo": workload.slo, "why": workload.why},
        "modes": {
            name: {
                "plan": plan.label,
                "candidate": plan.candidate.to_dict(),
                "predicted_rate": round(plan.rate, 3),
                "measured_rate": measured.get(name),
            }
            for name, plan in chosen.items()
        },
        **verdict(chosen, measured),
    }


def print_plans(plans: list[HostPlan], top: int = 8) -> None:
    print(f"  {'plan on the 2 cores':44} {'predicted req/s':>15} {'per device (search)':>20}")
    for p in plans[:top]:
        print(f"  {p.label:44} {p.rate:>15.3f} {p.per_device_rate:>20.3f}")


def print_verdict(result: dict) -> None:
    print(f"  {'mode':28} {'plan':44} {'predicted':>9} {'measured':>9} {'error':>7}")
    for name, mode in result["modes"].items():
        measured = mode["measured_rate"]
        error = result["errors"].get(name)
        print(
            f"  {name:28} {mode['plan']:44} {mode['predicted_rate']:>9.3f} "
            f"{f'{measured:.3f}' if measured is not None else '-':>9} {f'{error:+.0%}' if error is not None else '-':>7}"
        )
    print(
        f"  measured winner: {result['measured_winner']}; the pick is it: "
        f"{'yes' if result['pick_is_winner'] else 'no'}; pick's prediction within 10%: "
        f"{'yes' if result['pick_within_10pct'] else 'no'}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reuse", metavar="DIR", help="against the runs saved in DIR (no servers)")
    parser.add_argument("--out", default="loadtest/out/planner-verify", help="where runs are saved")
    parser.add_argument("--workloads", default="prefill-heavy,decode-heavy", help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--profile-1t", help="a 1-thread profile of this host (default: measured first)")
    parser.add_argument("--profile-2t", help="a 2-thread profile of this host (default: measured first)")
    parser.add_argument("--smoke", action="store_true", help="a short plan, the pick alone: runs, no figures")
    add_config_argument(parser)
    args = parser.parse_args(argv)
    print(host_line(), flush=True)
    out = Path(args.reuse or args.out)
    profile_1t, profile_2t = args.profile_1t, args.profile_2t
    if not (profile_1t and profile_2t):  # this host's, measured first (or kept from a run before)
        measured = profile_host(out / "profiles")
        profile_1t, profile_2t = profile_1t or measured[0], profile_2t or measured[1]
    effort = SMOKE if args.smoke else FULL
    workloads = args.workloads.split(",")
    run(out, workloads, profile_1t, profile_2t, bool(args.reuse), effort=effort, base_config=args.config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
