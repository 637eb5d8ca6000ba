"""`disagg plan`: the search on a cluster for a model, a workload and an SLO; prints the ranked
candidates and writes the best as a serving config `disagg serve --config` starts as it is."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from disagg.engine.model_specs import loadable_forms, model_spec_error
from disagg.planner.plan_config import hardware_label_comment, serving_config_dict

DEFAULT_REQUESTS = 300  # per simulation: enough for a P90, few enough for a search in seconds


def add_arguments(p, argparse) -> None:
    p.add_argument("--model", required=True, help="a model the planner knows (e.g. facebook/opt-13b, llama3-8b)")
    p.add_argument(
        "--serve-model",
        help="with -o: the model spec the written config serves (a GGUF file, an HF directory, random:<shape> "
        "or the default model); default: --model, which must then be one of those",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="profile JSON (measured, roofline or DistServe's) for the cluster's hardware")
    source.add_argument(
        "--hardware", help="plan from the roofline of this hardware (a100-80gb, h100-sxm, h200, l40s, cpu)"
    )
    p.add_argument("--cluster", required=True, help="NODESxDEVICES (e.g. 4x8), or a YAML/JSON file of node kinds")
    lengths = p.add_mutually_exclusive_group()
    lengths.add_argument("--workload", default="chat", help="chat | code | summarization | fixed (as `disagg bench`)")
    lengths.add_argument("--trace", help="take the prompt and output lengths from a trace file")
    p.add_argument("--slo", required=True, help="ttft_ms=..,tpot_ms=..")
    p.add_argument("--percentile", type=float, default=90.0, help="TTFT and TPOT at this percentile meet the SLO")
    p.add_argument("--attainment", type=float, default=90.0, help="percent of requests meeting both SLOs")
    p.add_argument("--rate", type=float, help="requests/s to provision for (replicas); default: best per device")
    p.add_argument("--num-requests", type=int, default=DEFAULT_REQUESTS, help="requests per simulation")
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", "-o", help="write the best plan as a serving config YAML here")
    p.add_argument(
        "--compare",
        metavar="CONFIG_OR_SPEC",
        help="simulate this deployment too and print it beside the best plan: a serving config YAML, "
        "or ROLE=tp<T>[pp<P>]x<N>[@HARDWARE],... (e.g. prefill=tp2x1,decode=tp1x1)",
    )
    p.add_argument("--json", help="write {best, candidates} here")
    p.add_argument("--top", type=int, default=10, help="candidates to print")


def main(args) -> int:
    from disagg.planner.models import model_spec
    from disagg.planner.reference import check_config_fits, parse_reference, reference_candidate
    from disagg.planner.search import Search
    from disagg.slo import parse_slo

    slo = parse_slo(args.slo)
    if not (slo.ttft_ms and slo.tpot_ms):
        raise ValueError("plan: --slo needs both ttft_ms and tpot_ms")
    config = model_spec(args.model)
    serve_model = check_serve_model(args) if args.output else None
    reference = parse_reference(args.compare) if args.compare else None
    kinds = cluster_kinds(args.cluster, args.model, args.profile, args.hardware)
    if args.compare and Path(args.compare).is_file():
        check_config_fits(args.compare, config, kinds)
    requests = _lengths(args, config.max_position_embeddings)
    search = Search(
        config, kinds, requests, slo, max_model_len=config.max_position_embeddings, seed=args.seed,
        percentile=args.percentile, attainment=args.attainment,
    )  # fmt: skip
    started = time.perf_counter()
    candidates = search.run(args.rate, progress=lambda line: print(f"  {line}", flush=True))
    elapsed = time.perf_counter() - started
    if not candidates or candidates[0].max_rate <= 0:
        print("no candidate meets the SLO at any rate")
        return 1
    print(table(candidates[: args.top]))
    print(f"{len(candidates)} candidates, {search.simulations} simulations in {elapsed:.1f} s")
    best = candidates[0]
    compared = reference_candidate(search, reference) if reference else None
    if compared is not None:
        print(comparison(best, compared, args.compare))
    if args.output:
        plan = serving_config_dict(best, args.model, slo, kinds, serve_model)
        header = _plan_header(args, best) + hardware_label_comment(best, kinds)
        Path(args.output).write_text(header + yaml.safe_dump(plan, sort_keys=False))
        print(f"wrote {args.output} (disagg serve --config {args.output})")
    if args.json:
        data = {"best": best.to_dict(), "candidates": [c.to_dict() for c in candidates], "search_s": elapsed}
        if compared is not None:
            data["reference"] = compared.to_dict()
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def check_serve_model(args) -> str:
    """The model spec a written plan serves: refused now, not when `disagg serve` fails to load it."""
    serve_model = args.serve_model or args.model
    error = model_spec_error(serve_model)
    if error:
        raise ValueError(
            f"plan -o: `disagg serve` cannot load the model {serve_model!r}: {error}. "
            f"The engine loads {loadable_forms()}. Give one with --serve-model "
            "(--model stays the shape the planner simulates), or plan without -o"
        )
    return serve_model


def cluster_kinds(cluster: str, model: str, profile_path: str | None, hardware_name: str | None):
    """The node kinds of `--cluster`, each with the profile of this model on its hardware."""
    from disagg.placement.profile import load_profile
    from disagg.planner.hardware import hardware_spec
    from disagg.planner.roofline import roofline_profile
    from disagg.planner.search import NodeKind

    given = load_profile(profile_path, model=model) if profile_path else None
    default_hardware = hardware_name or (given.hardware if given else None)
    kinds = []
    for hardware, nodes, devices in _parse_cluster(cluster, default_hardware):
        spec = hardware_spec(hardware)
        if given is not None and given.hardware == spec.name:
            profile = given
        else:  # every TP x PP the node could host; invalid ones are skipped by the search
            shapes = [(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if tp <= devices]
            profile = roofline_profile(model, spec, _valid(model, shapes))
        kinds.append(NodeKind(spec, profile, nodes, devices))
    return kinds


def _valid(model: str, shapes):
    from disagg.planner.memory import shape_error
    from disagg.planner.models import model_spec

    config = model_spec(model)
    return [s for s in shapes if not shape_error(config, *s)]


def _parse_cluster(cluster: str, default_hardware: str | None) -> list[tuple[str, int, int]]:
    """'4x8' (with the profile's or --hardware's kind) or a file: {nodes: [{hardware, count, devices}]}."""
    if Path(cluster).is_file():
        data = yaml.safe_load(Path(cluster).read_text()) or {}
        try:
            return [(n["hardware"], int(n.get("count", 1)), int(n["devices"])) for n in data["nodes"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"cluster file {cluster}: expected nodes: [{{hardware, count, devices}}] ({exc})"
            ) from None
    nodes, sep, devices = cluster.lower().partition("x")
    if not sep or not nodes.isdigit() or not devices.isdigit() or int(nodes) < 1 or int(devices) < 1:
        raise ValueError(f"cluster: {cluster!r} is not NODESxDEVICES (e.g. 4x8) or a cluster file")
    if default_hardware is None:
        raise ValueError("cluster: NODESxDEVICES needs --hardware, or a profile that names its hardware")
    return [(default_hardware, int(nodes), int(devices))]


def _lengths(args, context: int):
    from disagg.planner.workload import SimRequest, load_trace

    if args.trace:
        trace = load_trace(args.trace)
        return [SimRequest(i, 0.0, r.prompt_len, r.output_len) for i, r in enumerate(trace.requests)]
    from disagg.bench.workloads import WorkloadConfig, sample_lengths

    workload = WorkloadConfig(args.workload, args.num_requests, args.seed, context, args.length_scale)
    prompts, outputs = sample_lengths(workload)
    return [SimRequest(i, 0.0, int(p), int(o)) for i, (p, o) in enumerate(zip(prompts, outputs))]


def table(candidates) -> str:
    lines = [
        f"{'#':>2}  {'mode':13} {'prefill (tp,pp)xN':18} {'decode (tp,pp)xN':17} {'colocated':22} {'devices':>7} "
        f"{'max req/s':>9} {'req/s/device':>12}  algorithm"
    ]
    for i, c in enumerate(candidates, 1):
        pools = {role: f"({p.tp},{p.pp})x{p.instances} {p.hardware}" for role, p in c.pools.items()}
        colocated = c.pools.get("colocated")
        if colocated:
            pools["colocated"] += f" {colocated.scheduling_policy}/{colocated.max_num_batched_tokens}"
        lines.append(
            f"{i:>2}  {c.mode:13} {pools.get('prefill', '-'):18} {pools.get('decode', '-'):17} "
            f"{pools.get('colocated', '-'):22} {c.devices:>7} {c.max_rate:>9.3f} {c.goodput_per_device:>12.4f}  "
            f"{c.algorithm}"
        )
    return "\n".join(lines)


def comparison(best, reference, spec: str) -> str:
    """The reference deployment beside the best plan, and their goodput per device."""
    ratio = best.goodput_per_device / reference.goodput_per_device if reference.goodput_per_device else float("inf")
    return (
        f"\nbest plan beside the reference (--compare {spec}):\n"
        + table([best, reference])
        + f"\ngoodput per device: best {best.goodput_per_device:.4f}, reference {reference.goodput_per_device:.4f} "
        f"req/s/device (best / reference: {ratio:.2f}x)"
    )


def _plan_header(args, best) -> str:
    return (
        f"# Written by `disagg plan --model {args.model} --cluster {args.cluster} --slo {args.slo}`:\n"
        f"# {best.mode}, {best.devices} devices, {best.max_rate:.3f} req/s at the SLO "
        f"({best.goodput_per_device:.4f} per device), simulated.\n"
    )
