"""disagg against llama.cpp's server on the same CPU, same GGUF, same prompts (issue 38).

What a user on a CPU machine would pick instead of disagg is llama.cpp's `llama-server`, tried
as a new user would: the default GGUF (SmolLM2-135M-Instruct Q4_1), as many slots as the most
streams, a context for them all, 2 threads, defaults otherwise. llama.cpp is built once from the
sources in the `llama-cpp-python` sdist (loadtest/peers/llamacpp.py, cached). Against it, `disagg
serve`'s default deployment (1 prefill + 1 decode worker) over its OpenAI-compatible HTTP API.

One server at a time (2 cores): each is started, warmed up, measured at every number of streams,
and stopped. The load is closed loop (disagg.bench.load_client): `streams` clients send streamed
`/v1/completions` back to back (prose prompts of `--prompt-len` tokens from disagg.bench.workloads, each prompt once per
server, `--max-tokens` out, EOS ignored, greedy). Per level: output tokens/s (tokens from each
stream's usage) and TTFT p50 (first chunk with text). Prints `tok/s ratio @N` (disagg /
llama.cpp) and both TTFT p50s.

    .venv/bin/python -m loadtest.peers.vs_llamacpp [--streams 1 8 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from disagg.bench.launcher import Deployment, free_port
from disagg.bench.load_client import HttpApi, LoadRequest, LoadRun, closed_loop
from disagg.bench.results import host_line, write_results
from disagg.bench.workloads import WorkloadConfig, load_tokenizer, make_workload
from disagg.client import generate_request
from disagg.engine.loader import default_gguf_path
from loadtest.peers import llamacpp

MODEL = "smollm2-135m-instruct"  # both servers answer to this name
REQUEST_TIMEOUT_S = 600  # one request; at 32 streams on 2 cores a request may queue for minutes
WARM_UP_TOKENS = 16
SERVERS = ("llama.cpp", "disagg")
OUT = Path(__file__).resolve().parent / "out"


@dataclass
class Level:
    """One server at one number of streams."""

    streams: int
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    output_tokens: int = 0
    short_outputs: int = 0  # requests that came back with fewer tokens than asked (EOS not ignored?)
    wall_s: float = 0.0
    ttfts_s: list[float] = field(default_factory=list)
    load_avg_1m: float = 0.0  # when the level ended: how busy the machine was meanwhile

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def ttft_p50_s(self) -> float:
        return statistics.median(self.ttfts_s) if self.ttfts_s else float("nan")


def level_of(run: LoadRun, streams: int, max_tokens: int) -> Level:
    """One level's figures from its closed loop's records (output tokens as each usage counts them)."""
    level = Level(streams, requests=len(run.records), wall_s=run.duration_s, load_avg_1m=os.getloadavg()[0])
    for record in run.records:
        if not record.success:
            level.failures.append(f"{record.error_code}: {record.error}"[:200])
            continue
        level.ttfts_s.append(record.ttft)
        level.output_tokens += record.output_len
        level.short_outputs += record.output_len < max_tokens
    return level


async def level(api: HttpApi, prompts: list[str], streams: int, max_tokens: int) -> Level:
    """`streams` clients taking the prompts in turn, each sending its next as its last ends."""
    requests = [
        LoadRequest(generate_request(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for p in prompts
    ]
    return level_of(await closed_loop(api, requests, streams), streams, max_tokens)


async def measure(url: str, plan: dict[int, list[str]], warm_up: list[str], max_tokens: int) -> list[Level]:
    # A connection per request: llama-server may close a kept-alive one as the next request goes
    # out on it (seen as ServerDisconnectedError); both servers get the same.
    async with HttpApi(url, model=MODEL, timeout_s=REQUEST_TIMEOUT_S, connection_per_request=True) as api:
        # Warm-up: one request alone, then as many at once as the most streams (buffers for big batches).
        for warm in (await level(api, warm_up[:1], 1, WARM_UP_TOKENS),
                     await level(api, warm_up[1:], len(warm_up) - 1, WARM_UP_TOKENS)):  # fmt: skip
            if warm.failures:
                print(f"  warm-up: {describe(warm)}", flush=True)
        levels = []
        for streams, prompts in plan.items():
            levels.append(await level(api, prompts, streams, max_tokens))
            print(f"  {describe(levels[-1])}", flush=True)
    return levels


def describe(level: Level) -> str:
    failed = f", {len(level.failures)} FAILED ({level.failures[0]})" if level.failures else ""
    failed += f", {level.short_outputs} SHORT" if level.short_outputs else ""
    return (
        f"@{level.streams}: {level.tokens_per_s:.1f} tok/s, TTFT p50 {level.ttft_p50_s:.2f} s, "
        f"{level.requests} requests, {level.output_tokens} tokens in {level.wall_s:.1f} s, "
        f"load {level.load_avg_1m:.2f}{failed}"
    )


def make_prompts(args) -> tuple[dict[int, list[str]], list[str]]:
    """Per level its own prompts (no level hits a prefix another cached), and the warm-up's."""
    tokenizer, context = load_tokenizer()
    counts = [max(args.min_requests, n * args.requests_per_stream) for n in args.streams]
    config = WorkloadConfig(name="fixed", num_requests=sum(counts) + 1 + max(args.streams), seed=args.seed,
                            context_len=context, input_len=args.prompt_len, output_len=args.max_tokens)  # fmt: skip
    texts = [r.prompt for r in make_workload(config, tokenizer)]
    plan, at = {}, 0
    for streams, count in zip(args.streams, counts):
        plan[streams], at = texts[at : at + count], at + count
    return plan, texts[at:]


def wait_for_quiet(max_load: float, max_wait_s: float, poll_s: float = 30) -> bool:
    """Whether the 1-min load average fell below `max_load` within `max_wait_s` (then go on)."""
    deadline = time.monotonic() + max_wait_s
    while (load := os.getloadavg()[0]) >= max_load:
        if time.monotonic() > deadline:
            print(f"load average still {load:.2f} after {max_wait_s:.0f}s: measuring anyway", flush=True)
            return False
        print(f"load average {load:.2f} >= {max_load}: waiting {poll_s:.0f}s", flush=True)
        time.sleep(poll_s)
    return True


def run_llamacpp(args, gguf: str, plan, warm_up, workdir: Path) -> list[Level]:
    binary = llamacpp.binaries(args.llamacpp_version)["llama-server"]
    server = llamacpp.LlamaServer(binary, gguf, free_port(), slots=max(args.streams),
                                  slot_context=args.slot_context, threads=args.threads,
                                  log=workdir / "llama-server.log")  # fmt: skip
    print(f"llama.cpp: {' '.join(server.command)}", flush=True)
    with server:
        return asyncio.run(measure(server.url, plan, warm_up, args.max_tokens))


def run_disagg(args, plan, warm_up, workdir: Path) -> list[Level]:
    # The default deployment; re-planning and the start-up calibration off, to start sooner.
    settings = {"replan": False, "calibration_s": 0, **dict(args.disagg_set)}
    with Deployment(settings, workdir=workdir, name="disagg", http=True) as dep:
        print(f"disagg: disagg serve --config {dep.config_path}: {settings} (defaults otherwise)", flush=True)
        return asyncio.run(measure(dep.http_url, plan, warm_up, args.max_tokens))


def report(results: dict[str, list[Level]]) -> None:
    for ours, theirs in zip(results["disagg"], results["llama.cpp"]):
        n = ours.streams
        ratio = ours.tokens_per_s / theirs.tokens_per_s if theirs.tokens_per_s else float("nan")
        print(f"tok/s ratio @{n}: {ratio:.2f}  "
              f"(disagg {ours.tokens_per_s:.1f}, llama.cpp {theirs.tokens_per_s:.1f})")  # fmt: skip
        print(f"TTFT p50 @{n}: disagg {ours.ttft_p50_s:.2f} s, llama.cpp {theirs.ttft_p50_s:.2f} s")


def write_json(path: str, args, results: dict[str, list[Level]], quiet: dict[str, bool]) -> None:
    meta = {"llamacpp_version": args.llamacpp_version, "load_below_max_at_start": quiet}
    levels = {
        server: [{**asdict(lv), "tokens_per_s": lv.tokens_per_s, "ttft_p50_s": lv.ttft_p50_s} for lv in found]
        for server, found in results.items()
    }
    write_results(path, {"meta": meta, "levels": levels}, args)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per level: this x streams ...")
    p.add_argument("--min-requests", type=int, default=4, help="... and at least this many")
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    p.add_argument("--slot-context", type=int, default=512, help="llama-server's -c is this x slots")
    p.add_argument("--llamacpp-version", default=llamacpp.VERSION, help="of the llama-cpp-python sdist")
    p.add_argument("--max-load", type=float, default=1.2, help="wait for a 1-min load average below this")
    p.add_argument("--max-load-wait-s", type=float, default=1500)
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS), help="one alone: no ratio")
    p.add_argument("--json", help="write the figures here")
    p.add_argument(
        "--disagg-set", type=_setting, action="append", default=[], metavar="KEY=VALUE",
        help="a setting of disagg's config (YAML value), e.g. threads_per_worker=2; repeatable",
    )  # fmt: skip
    p.add_argument("--out-dir", default=str(OUT), help="the servers' logs go under it, kept for a post-mortem")
    return p.parse_args(argv)


def _setting(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    return key, yaml.safe_load(value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (`timeout`, a CI) unwinds like Ctrl-C, so that the server running is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.prompt_len + args.max_tokens > args.slot_context:
        sys.exit("--prompt-len + --max-tokens must fit --slot-context")
    gguf = default_gguf_path()
    if "llama.cpp" in args.servers:
        llamacpp.binaries(args.llamacpp_version)  # the build (minutes, once) before any waiting or measuring
    plan, warm_up = make_prompts(args)
    # The servers' logs stay for a post-mortem (loadtest/out/ is git-ignored).
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="vs_llamacpp-", dir=args.out_dir))
    print(f"{host_line()}; {gguf}; logs in {workdir}", flush=True)
    runs = {"llama.cpp": lambda: run_llamacpp(args, gguf, plan, warm_up, workdir),
            "disagg": lambda: run_disagg(args, plan, warm_up, workdir)}  # fmt: skip
    quiet, results = {}, {}
    for server in args.servers:
        # Before each server, not once: another job may start while the first one is measured.
        quiet[server] = wait_for_quiet(args.max_load, args.max_load_wait_s)
        results[server] = runs[server]()
    if len(results) == 2:
        report(results)
    if args.json:
        write_json(args.json, args, results, quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
