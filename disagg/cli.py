"""`disagg` command line: generate (offline for now), with serve/bench/plan to come."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from disagg.config import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: a clear message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion offline with the engine in this process")
    p.add_argument("prompt", help="the user message (sent through the model's chat template unless --raw)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file, Hugging Face directory, random:<shape> or the default model")
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
    from disagg import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens)
    started = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads)
    loaded = time.perf_counter()
    engine = llm.engine
    if args.raw or engine.tokenizer is None:
        engine.add_request("cli", prompt=args.prompt, sampling_params=params)
    else:
        engine.add_request("cli", prompt_token_ids=engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]), sampling_params=params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.new_text, end="", flush=True)
            final = out
    print()
    if args.stats and final is not None:
        m = final.metrics
        n = len(final.outputs[0].token_ids)
        print(f"load {loaded - started:.2f}s  ttft {m.ttft * 1e3:.0f}ms  {n} tokens in {m.e2e:.2f}s  finish={final.outputs[0].finish_reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
