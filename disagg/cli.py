"""`disagg` command line: serve, stop, generate (against a server, or offline), status."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from disagg.config import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: a clear message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_stop(sub)
    _add_generate(sub)
    _add_status(sub)
    _add_bench_commands(sub)
    _add_profile_command(sub)
    _add_planner_commands(sub)
    return parser


def _add_bench_commands(sub) -> None:
    """`disagg bench | report | experiment` live with the load-testing code (disagg/bench/)."""
    try:
        from disagg.bench.cli import add_commands
    except ImportError:  # the bench package is optional at this layer
        return
    add_commands(sub)


def _add_profile_command(sub) -> None:
    """`disagg profile` lives with the profiler (disagg/profiling/), beside the planner: it runs an engine."""
    from disagg.profiling.cli import add_command

    add_command(sub)


def _add_planner_commands(sub) -> None:
    """`disagg simulate | plan` live with the planner (disagg/planner/)."""
    from disagg.planner_cli.simulate_cli import add_commands

    add_commands(sub)


def _add_serve(sub) -> None:
    from disagg.settings.flags import add_setting_flags

    p = sub.add_parser(
        "serve",
        help="serve the model over gRPC and an OpenAI-compatible HTTP API "
        "(default: local Ray, local Redis, 1 prefill + 1 decode worker)",
        usage="disagg serve [--config FILE] [--SETTING VALUE ...] [--ready-file FILE] [--cluster]",
        description="Serve the model. Every setting of the serving config is a flag below (docs/settings.md); "
        "a flag overrides the --config file, which overrides the defaults.",
    )
    p.add_argument("--config", metavar="FILE", help="YAML serving config (see deploy/configs/)")
    p.add_argument("--ready-file", metavar="FILE", help="write HOST:PORT here once serving (for scripts)")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="join the running Ray cluster (`ray up deploy/cluster.yaml`) and pin each pool to the nodes "
        "labelled with its name, waiting for them to join",
    )
    add_setting_flags(p)
    p.set_defaults(func=_serve)


def _serve(args) -> int:
    from disagg.server import main_serve
    from disagg.settings.flags import settings_from_flags

    logging.getLogger("disagg").setLevel(logging.INFO)
    return main_serve(args.config, settings_from_flags(args), args.ready_file, args.cluster)


def _add_stop(sub) -> None:
    p = sub.add_parser(
        "stop",
        help="end the deployment `disagg serve` started on this machine (its frontends, workers, "
        "controller, and the Ray head and redis-server it started), whether or not that process lives",
    )
    p.add_argument(
        "--cluster",
        action="store_true",
        help="end every deployment on the Ray cluster of this node (`ray up`), not the one recorded here",
    )
    p.set_defaults(func=_stop)


def _stop(args) -> int:
    from disagg.deployments import stop_deployment
    from disagg.cluster.deployment_state import load_state

    if args.cluster:
        import ray

        ray.init(address="auto", logging_level=logging.WARNING)
        state = None
    else:
        state = load_state()
        if state is None:
            print("disagg: no deployment recorded on this machine", file=sys.stderr)
            return 1
    for line in stop_deployment(state):
        print(f"disagg: {line}", flush=True)
    print("disagg: stopped", flush=True)
    return 0


def _add_status(sub) -> None:
    p = sub.add_parser("status", help="pools and instances of a running server")
    p.add_argument("--server", default="127.0.0.1:50051")
    p.add_argument("--tls-ca", help="PEM CA file: connect with TLS (the API key comes from $DISAGG_API_KEY)")
    p.set_defaults(func=_status)


def _status(args) -> int:
    from disagg.client import DisaggClient

    with DisaggClient(args.server, tls_ca=args.tls_ca) as client:
        status = client.cluster_status()
    print(f"{status.model} ({status.mode})")
    for pool in status.pools:
        for i in pool.instances:
            print(
                f"  {pool.role:9} {i.instance_id:24} running={i.num_running} waiting={i.num_waiting} kv={i.kv_cache_usage:.0%} tp={i.tensor_parallel_size} pp={i.pipeline_parallel_size} heartbeat {i.heartbeat_age_s:.1f}s ago"
            )
            print(f"  {'':9} {_model_line(i.latency_model)}")
            if i.kv_paths:
                print(f"  {'':9} kv paths: {', '.join(f'{peer} {path}' for peer, path in sorted(i.kv_paths.items()))}")
            if i.kv_tiers:
                print(f"  {'':9} {_tiers_line(i.kv_tiers)}")
    _print_replanning(status)
    return 0


def _tiers_line(tiers) -> str:
    """Hits and bytes by tier, and the prefix index: one line of `disagg status`."""
    hits = " ".join(f"{t}={int(tiers.get(f'hit_blocks.{t}', 0))}" for t in ("pool", "host", "disk"))
    held = " ".join(
        f"{t}={tiers[f'held_bytes.{t}'] / 2**20:.1f}MiB" for t in ("host", "disk") if f"held_bytes.{t}" in tiers
    )
    index = f"index {int(tiers.get('index.entries', 0))} blocks, lag {tiers.get('index.lag_s', 0.0) * 1e3:.0f} ms"
    line = f"kv tiers: hit blocks {hits}; held {held}; {index}"
    if "peer.fetched_blocks" in tiers:  # a prefill instance: what it fetched from peers (disagg.router.peer_fetch)
        fetched = tiers["peer.fetched_blocks"], tiers.get("peer.fetched_bytes", 0) / 2**20
        line += f"; fetched from peers {int(fetched[0])} blocks ({fetched[1]:.1f}MiB)"
    return line


def _print_replanning(status, shown: int = 5) -> None:
    if not status.replan:
        print("re-planning: off")
        return
    print(f"re-planning: on; latest {min(shown, len(status.replan_decisions))} decisions")
    for d in status.replan_decisions[:shown]:
        when = time.strftime("%H:%M:%S", time.localtime(d.unix_time))
        done = {"add": "added", "remove": "removed"}.get(d.step_kind, "switched")
        switch = (
            f"; {done} {d.switched_instance}: {d.switch_outcome} in {d.switch_seconds:.1f}s"
            if d.switched_instance
            else ""
        )
        print(f"  {when} {d.current} -> best {d.best} (+{d.predicted_gain:.1f} points): {d.reason}{switch}")
        if d.check_outcome:
            print(f"    checked: {_check_line(d)}")


def _check_line(d) -> str:
    """A switch's prediction beside what the window after it measured (issue 53)."""
    if d.check_outcome == "pending":
        return f"pending; predicted {d.predicted_attainment:.1f}% attainment, {d.predicted_goodput:.2f} req/s"
    return (
        f"{d.check_outcome}; predicted {d.predicted_attainment:.1f}% / {d.predicted_goodput:.2f} req/s, "
        f"measured {d.measured_attainment:.1f}% / {d.measured_goodput:.2f} req/s, staying {d.stay_attainment:.1f}%"
    )


def _model_line(m) -> str:
    """An instance's latency model as `disagg status` shows it."""
    numbers = lambda values: ", ".join(f"{v:.3g}" for v in values)  # noqa: E731
    state = "fitted" if m.calibrated else "guessed"
    return (
        f"model ({state}, {m.num_steps} steps, recent error {m.recent_error:.0%}): "
        f"prefill ms = [{numbers(m.prefill)}] . [1, tokens, attention]; decode ms = [{numbers(m.decode)}] . [1, context, batch]"
    )


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate a completion: from a server with --server, else offline in this process"
    )
    p.add_argument("prompt", help="the user message (sent through the model's chat template unless --raw)")
    p.add_argument("--server", help="HOST:PORT of a `disagg serve`; without it the engine runs in this process")
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="GGUF file, Hugging Face directory, random:<shape> or the default model"
    )
    p.add_argument("--tls-ca", help="with --server: PEM CA file, connect with TLS (API key: $DISAGG_API_KEY)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.add_argument("--stats", action="store_true", help="print timings to stderr")
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    if args.server:
        return _generate_remote(args)
    from disagg import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
    )
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads)
    loaded = time.perf_counter()
    engine = llm.engine
    if args.raw or engine.tokenizer is None:
        engine.add_request("cli", prompt=args.prompt, sampling_params=params)
    else:
        engine.add_request(
            "cli",
            prompt_token_ids=engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]),
            sampling_params=params,
        )
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.new_text, end="", flush=True)
            final = out
    print()
    if args.stats and final is not None:
        m = final.metrics
        n = len(final.outputs[0].token_ids)
        print(
            f"load {loaded - started:.2f}s  ttft {m.ttft * 1e3:.0f}ms  {n} tokens in {m.e2e:.2f}s  finish={final.outputs[0].finish_reason}",
            file=sys.stderr,
        )
    return 0


def _generate_remote(args) -> int:
    import grpc

    from disagg.client import DisaggClient, generate_request

    sampling = dict(
        temperature=args.temperature, max_tokens=args.max_tokens, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    request = (
        generate_request(args.prompt, **sampling)
        if args.raw
        else generate_request(chat=[{"role": "user", "content": args.prompt}], **sampling)
    )
    try:
        with DisaggClient(args.server, tls_ca=args.tls_ca) as client:
            for msg in client.stream(request, timeout=600):
                print(msg.text, end="", flush=True)
                final = msg
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print()
    if args.stats:
        t = final.timings
        print(
            f"ttft {t.ttft_s * 1e3:.0f}ms (queue {t.queue_s * 1e3:.0f} prefill {t.prefill_s * 1e3:.0f} transfer {t.transfer_s * 1e3:.0f})  {final.usage.completion_tokens} tokens in {t.e2e_s:.2f}s  finish={final.finish_reason}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
