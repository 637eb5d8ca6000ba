"""What batch-independent numerics cost: decode steps at several batch sizes and one long
prompt's prefill, on the default model (SmolLM2-135M's Q4_1 GGUF, 4-bit weights, CPU).

Each side is a source tree (its `disagg` package) run in a subprocess of its own, the sides
alternating run by run (the host is shared: medians of --repeats runs each):

    python -m loadtest.engine.batch_invariance --sides /tmp/base . --repeats 3
    python -m loadtest.engine.batch_invariance --sides . --smoke      # runs, no figures

With --interleaved, one process instead, its engine switched step by step between today's
numerics and the previous default (a decode row on the float copy past 4 decodes, a prompt's
attention as plain causal SDPA), the fastest of --repeats blocks of each: on a shared host the
only figures steadier than the noise.

    python -m loadtest.engine.batch_invariance --interleaved --repeats 9

Decode: `batch` requests of a 16-token prompt, each step's time taken once every request
decodes (tok/s = batch / step time). Prefill: one prompt of --prefill-len tokens, to its first
token. Also the capital-of-France answer, which must not change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from disagg.bench.results import host_line

FRANCE = "What is the capital of France?"


def side(batches: list[int], steps: int, prefill_len: int) -> dict:
    """This process's figures (its `disagg` is the side's)."""
    import torch

    from disagg import LLM, SamplingParams

    llm = LLM(num_kv_blocks=1024)
    figures = {f"decode_tok_s@{b}": _decode_rate(llm, b, steps) for b in batches}
    prompt = [{"prompt_token_ids": [(7 * i) % 40000 + 100 for i in range(prefill_len)]}]
    started = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    figures[f"prefill_s@{prefill_len}"] = time.perf_counter() - started
    chat = llm.chat([{"role": "user", "content": FRANCE}], SamplingParams(temperature=0.0, max_tokens=12))
    figures["france"] = chat[0].outputs[0].text
    figures["threads"] = torch.get_num_threads()
    return figures


def _decode_rate(llm, batch: int, steps: int) -> float:
    from disagg import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", prompt_token_ids=[(31 * i + j) % 40000 + 100 for j in range(16)],
                           sampling_params=params)  # fmt: skip
    engine.step()  # the prompts
    engine.step()  # the first decode (warm)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    rate = batch * steps / (time.perf_counter() - started)
    while engine.has_unfinished_requests():
        engine.step()
    return rate


def interleaved(batches: list[int], repeats: int, prefill_lens: list[int]) -> dict:
    """Each figure's fastest block under the previous numerics ("before") and today's ("after")."""
    from disagg import LLM

    llm = LLM(num_kv_blocks=2048)
    figures = {}
    for batch in batches:
        figures[f"decode_step_ms@{batch}"] = _interleaved_decode(llm, batch, repeats)
    for length in prefill_lens:
        figures[f"prefill_s@{length}"] = _interleaved_prefill(llm, length, 1, max(3, repeats // 3))
    figures["prefill_s@16x32"] = _interleaved_prefill(llm, 32, 16, max(3, repeats // 3))  # the most padding
    return figures


def _previous_numerics(llm, on: bool) -> None:
    """Today's engine made to compute as the previous default did (on) or as it does (off)."""
    from disagg.engine.layers import attention
    from disagg.engine.layers.quantized import QUANTIZED_MAX_ROWS, _QuantizedGemm

    if not hasattr(attention, "_tiled_prefill"):
        attention._tiled_prefill = attention._prefill_attention

    for module in llm.engine.model.modules():
        for weight in vars(module).values():
            if isinstance(weight, _QuantizedGemm) and weight.kernels is not None and weight._wide is not None:
                weight.max_narrow_decodes = QUANTIZED_MAX_ROWS if on else None
    attention._prefill_attention = attention._untiled_prefill_attention if on else attention._tiled_prefill


def _interleaved_decode(llm, batch: int, repeats: int) -> tuple[float, float]:
    from disagg import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=8 * repeats + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"i{batch}-{i}", prompt_token_ids=[(31 * i + j) % 40000 + 100 for j in range(16)],
                           sampling_params=params)  # fmt: skip
    engine.step()
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for side, previous in enumerate((True, False)):
            _previous_numerics(llm, previous)
            engine.step()  # warm
            started = time.perf_counter()
            for _ in range(3):
                engine.step()
            best[side] = min(best[side], (time.perf_counter() - started) / 3 * 1e3)
    while engine.has_unfinished_requests():
        engine.step()
    _previous_numerics(llm, False)
    return tuple(best)


def _interleaved_prefill(llm, length: int, count: int, repeats: int) -> tuple[float, float]:
    """`count` prompts of `length` tokens, to their first tokens (no two sharing a prefix)."""
    from disagg import SamplingParams

    best = [float("inf"), float("inf")]
    for repeat in range(repeats):
        for side, previous in enumerate((True, False)):
            _previous_numerics(llm, previous)
            first = 2 * repeat + side
            prompts = [
                {"prompt_token_ids": [(7 * i + 13 * n + first) % 40000 + 100 for i in range(length)]}
                for n in range(count)
            ]
            started = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            best[side] = min(best[side], time.perf_counter() - started)
    _previous_numerics(llm, False)
    return tuple(best)


def run_side(tree: str, args) -> dict:
    code = (
        "import json, sys; from loadtest.engine import batch_invariance as b; "
        f"print(json.dumps(b.side({args.batches!r}, {args.steps!r}, {args.prefill_len!r})))"
    )
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree), here]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"side {tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sides", nargs="+", default=["."], help="source trees, each with its disagg package")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--smoke", action="store_true", help="batches 1 and 2, 4 steps, a 64-token prompt, once")
    p.add_argument("--interleaved", action="store_true", help="one process, before and after step by step")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 512, 2048], help="with --interleaved")
    args = p.parse_args(argv)
    if args.interleaved:
        print(host_line(), flush=True)
        for name, (before, after) in interleaved(args.batches, args.repeats, args.prompt_lens).items():
            print(f"{name}: before {before:.3f}, after {after:.3f} ({after / before - 1:+.1%})", flush=True)
        return 0
    if args.smoke:
        args.repeats, args.batches, args.steps, args.prefill_len = 1, [1, 2], 4, 64
    print(host_line(), flush=True)
    runs: dict[str, list[dict]] = {tree: [] for tree in args.sides}
    for repeat in range(args.repeats):
        for tree in args.sides:
            runs[tree].append(run_side(tree, args))
            print(f"run {repeat + 1} {tree}: {json.dumps(runs[tree][-1])}", flush=True)
    for tree, figures in runs.items():
        medians = {k: statistics.median(f[k] for f in figures) for k in figures[0] if isinstance(figures[0][k], float)}
        print(f"{tree}: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()) + f"; {figures[0]['france']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
