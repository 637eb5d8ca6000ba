"""Fair prefill (issue 40, item 4): short chat prompts sent just after a long prompt, with the
engine's fair prefill on (`long_prefill_token_threshold` at its default, a quarter of the
budget; its caps counting work, `long_prefill_by_work`, the default), on with caps by tokens
only (`fair-tokens`), and off (0: the prompt that came first takes every step's whole budget).

    .venv/bin/python -m loadtest.engine.fair_prefill [--json FILE]
    .venv/bin/python -m loadtest.engine.fair_prefill --smoke     # random weights, seconds

The real engine (the default model, SmolLM2-135M, on CPU) in this process, stepped in a thread of
its own that takes new requests between steps, as a worker does. One long prompt (8,000 tokens
of real text, or as many as the model's context allows) is sent, then `--shorts` short chat
prompts `--delay-ms` later, while the long one's first chunk is being computed. Each short's
TTFT is from its sending to its first token. Unloaded TTFT: each short alone on the idle engine.
Prefix caching is off, so that no run is helped by what an earlier one left cached.

Printed, for each setting: `short ttft p50/max ms`, `long ttft ms`; then `unloaded ttft ms`,
`chunk ms` (a step of the long prompt alone under the whole budget, the median of the runs with
fair prefill off; then its first and last such step), `bound ms` (2 x unloaded + one chunk: the
issue's target), `within bound: yes|no` (every short's TTFT with fair prefill on, and by tokens
only), `long ttft ratio fair/off` (and fair-tokens/off).
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

from disagg.bench.results import host_line, write_results
from disagg.config import EngineConfig
from disagg.engine.engine import LLMEngine
from disagg.request import SamplingParams

CHATS = [
    "What is the capital of France?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "Name a primary colour.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Which planet is closest to the sun?",
    "What does CPU stand for?",
]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the engine's default model")
    p.add_argument("--long-tokens", type=int, default=8000, help="capped by the model's context")
    p.add_argument("--shorts", type=int, default=6)
    p.add_argument("--short-max-tokens", type=int, default=8)
    p.add_argument("--delay-ms", type=float, default=50.0, help="the shorts are sent this long after the long one")
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="off and fair runs, alternating")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--smoke", action="store_true", help="random weights, a 256-token prompt: seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.long_tokens, args.budget, args.threads, args.delay_ms = "random:tiny", 256, 64, 1, 1.0
    return args


# ---- the engine, stepped as a worker steps it ----------------------------------------------------
class EngineLoop:
    """Steps the engine in a thread; requests come through a queue taken between steps, and
    each request's first-token time is recorded."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.inbox: queue.Queue = queue.Queue()
        self.first_token: dict[str, float] = {}
        self.done: dict[str, threading.Event] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def send(self, request_id: str, token_ids: list[int], max_tokens: int) -> float:
        """Queue a greedy request; returns when it was sent."""
        self.done[request_id] = threading.Event()
        sent = time.perf_counter()
        self.inbox.put((request_id, token_ids, max_tokens))
        return sent

    def wait(self, request_ids, timeout_s: float = 900.0) -> None:
        for rid in request_ids:
            if not self.done[rid].wait(timeout_s):
                raise TimeoutError(f"{rid} did not finish in {timeout_s} s")

    def close(self) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.is_set():
            self._take_new()
            if not self.engine.has_unfinished_requests():
                time.sleep(0.001)
                continue
            for out in self.engine.step():
                now = time.perf_counter()
                self.first_token.setdefault(out.request_id, now)
                if out.finished:
                    self.done[out.request_id].set()

    def _take_new(self) -> None:
        while True:
            try:
                rid, ids, max_tokens = self.inbox.get_nowait()
            except queue.Empty:
                return
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            self.engine.add_request(rid, prompt_token_ids=ids, sampling_params=params)


# ---- the prompts ---------------------------------------------------------------------------------
def long_prompt(engine: LLMEngine, tokens: int) -> list[int]:
    """`tokens` of real text (the Python reference manual), or random ids without a tokenizer."""
    if engine.tokenizer is None:
        return [(i * 7919) % (engine.model_config.vocab_size - 3) + 3 for i in range(tokens)]
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics.values())
    return engine.tokenizer.encode(text[: 8 * tokens])[:tokens]  # ~4 characters a token: enough text


def short_prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    if engine.tokenizer is None:
        return [[(k * 104729 + i * 31) % (engine.model_config.vocab_size - 3) + 3 for i in range(30)] for k in range(n)]
    chat = engine.tokenizer.apply_chat_template
    return [chat([{"role": "user", "content": CHATS[k % len(CHATS)]}]) for k in range(n)]


# ---- one run -------------------------------------------------------------------------------------
@dataclass
class Run:
    setting: str
    short_ttft_ms: list[float] = field(default_factory=list)
    long_ttft_ms: float = 0.0
    long_alone_step_ms: list[float] = field(default_factory=list)  # steps of the long prompt alone, whole budget


def behind_long(loop: EngineLoop, setting: str, long_ids: list[int], shorts: list[list[int]], args, tag: str) -> Run:
    engine, run = loop.engine, Run(setting)
    steps_before = engine.num_steps
    long_id = f"long-{tag}"
    long_sent = loop.send(long_id, long_ids, 1)
    time.sleep(args.delay_ms / 1e3)
    sent = {f"short{k}-{tag}": loop.send(f"short{k}-{tag}", ids, args.short_max_tokens) for k, ids in enumerate(shorts)}
    loop.wait([long_id, *sent])
    run.long_ttft_ms = (loop.first_token[long_id] - long_sent) * 1e3
    run.short_ttft_ms = [(loop.first_token[rid] - t) * 1e3 for rid, t in sent.items()]
    new_steps = list(engine.step_stats)[-(engine.num_steps - steps_before) :]
    run.long_alone_step_ms = [
        s.ms
        for s in new_steps
        if len(s.work.chunks) == 1 and s.work.prefill_tokens == args.budget and not s.work.num_decodes
    ]
    return run


def unloaded(loop: EngineLoop, shorts: list[list[int]], args) -> list[float]:
    """Each short alone on the idle engine (after one untimed warm-up request)."""
    loop.send("warm", shorts[0], args.short_max_tokens)
    loop.wait(["warm"])
    ttfts = []
    for k, ids in enumerate(shorts):
        rid = f"alone{k}"
        sent = loop.send(rid, ids, args.short_max_tokens)
        loop.wait([rid])
        ttfts.append((loop.first_token[rid] - sent) * 1e3)
    return ttfts


def engine_for(args, threshold: int | None) -> LLMEngine:
    settings = dict(
        max_num_batched_tokens=args.budget,
        long_prefill_token_threshold=threshold,
        num_threads=args.threads,
        enable_prefix_caching=False,
    )
    if args.model:
        settings["model"] = args.model
    return LLMEngine(EngineConfig(**settings))


def main(argv=None) -> int:
    args = parse_args(argv)
    print(host_line(), flush=True)
    # One engine (one load of the weights); the setting is the scheduler's, switched between runs.
    engine = engine_for(args, None)
    fair_threshold = engine.scheduler.long_prefill_token_threshold
    by_work = engine.scheduler.attention_context_tokens
    long_ids = long_prompt(engine, min(args.long_tokens, engine.max_model_len - 2))
    shorts = short_prompts(engine, args.shorts)
    loop = EngineLoop(engine)
    try:
        alone = unloaded(loop, shorts, args)
        runs: dict[str, list[Run]] = {"off": [], "fair": [], "fair-tokens": []}
        settings = (("off", 0, None), ("fair", fair_threshold, by_work), ("fair-tokens", fair_threshold, None))
        for r in range(args.repeats):
            for setting, threshold, context_tokens in settings:
                engine.scheduler.long_prefill_token_threshold = threshold  # between steps: nothing in flight
                engine.scheduler.attention_context_tokens = context_tokens
                runs[setting].append(behind_long(loop, setting, long_ids, shorts, args, f"{setting}{r}"))
    finally:
        loop.close()
    report(args, len(long_ids), engine.scheduler.chunk_cap, alone, runs)
    return 0


def report(args, long_tokens: int, cap: int, alone: list[float], runs: dict[str, list["Run"]]) -> None:
    unloaded_ms = statistics.median(alone)
    chunk_steps = [ms for run in runs["off"] for ms in run.long_alone_step_ms]
    chunk_ms = statistics.median(chunk_steps) if chunk_steps else float("nan")
    first_run = runs["off"][0].long_alone_step_ms or [float("nan")]  # in order: attention grows along the prompt
    bound_ms = 2 * unloaded_ms + chunk_ms
    figures: dict = {"long_tokens": long_tokens, "budget": args.budget, "fair_cap": cap, "shorts": args.shorts}
    print(f"long prompt {long_tokens} tokens, then {args.shorts} short chat prompts {args.delay_ms:.0f} ms later;")
    print(f"budget {args.budget} tokens a step, fair prefill's cap {cap}; {args.repeats} run(s) of each setting")
    for setting, setting_runs in runs.items():
        shorts = [ms for run in setting_runs for ms in run.short_ttft_ms]
        longs = [run.long_ttft_ms for run in setting_runs]
        figures[setting] = {"short_ttft_ms": shorts, "long_ttft_ms": longs}
        print(
            f"{setting}: short ttft p50/max ms: {statistics.median(shorts):.0f} / {max(shorts):.0f}; "
            f"long ttft ms: {statistics.median(longs):.0f}"
        )
    off_long = statistics.median(r.long_ttft_ms for r in runs["off"])
    ratios = {
        name: statistics.median(r.long_ttft_ms for r in runs[name]) / off_long for name in ("fair", "fair-tokens")
    }
    within = {name: max(ms for run in runs[name] for ms in run.short_ttft_ms) <= bound_ms for name in ratios}
    figures.update(unloaded_ttft_ms=alone, chunk_ms=chunk_ms, chunk_ms_steps=first_run, bound_ms=bound_ms)
    figures["long_ttft_ratio"], figures["long_ttft_ratio_by_tokens"] = ratios["fair"], ratios["fair-tokens"]
    figures["within_bound"], figures["within_bound_by_tokens"] = within["fair"], within["fair-tokens"]
    print(f"unloaded ttft ms: {unloaded_ms:.0f}")
    print(f"chunk ms: {chunk_ms:.0f}")
    print(f"chunk ms along the long prompt, first / last: {first_run[0]:.0f} / {first_run[-1]:.0f}")
    print(f"bound ms: {bound_ms:.0f}")
    print(
        f"within bound: {'yes' if within['fair'] else 'no'} (by tokens only: {'yes' if within['fair-tokens'] else 'no'})"
    )
    print(f"long ttft ratio fair/off: {ratios['fair']:.3f} (by tokens only: {ratios['fair-tokens']:.3f})")
    if args.json:
        write_results(args.json, figures, args)


if __name__ == "__main__":
    sys.exit(main())
