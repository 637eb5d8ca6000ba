"""Weights kept quantized against float32, on the default model, one run (issue 38).

Each side (`engine.weights`: fp32, auto = the GGUF's Q4_1 blocks as int4, its Q8_0 embedding as
int8) runs in its own subprocess, so that its peak RSS is its own: an `LLM` engine decodes
greedy requests (windows of Python's documentation, 100 tokens, EOS ignored) at batch 1, 8 and 32, and a
prefill of 16 prompts of 512 tokens. Then the greedy outputs of a prompt set are compared with
float32's: the share of prompts whose first 32 tokens agree, and the mean agreeing prefix.

    .venv/bin/python -m loadtest.engine.quantized [--sides fp32 auto] [--json PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time

from disagg.bench.results import host_line, write_results


@dataclasses.dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...] = (1, 8, 32)
    decode_tokens: int = 64
    prefill_prompts: int = 16
    prefill_len: int = 512
    agreement_prompts: int = 24
    agreement_len: int = 60
    agreement_tokens: int = 32


FULL = Sizes()
# Every prompt 100 tokens, as the warm-up's: oneDNN builds kernels per row count, about a second each.
SMOKE = Sizes(
    batches=(1,), decode_tokens=2, prefill_prompts=1, prefill_len=100, agreement_prompts=1, agreement_len=100,
    agreement_tokens=2,
)  # fmt: skip


def prompts(llm, count: int, length: int) -> list[list[int]]:
    """Disjoint windows of real text (Python's own documentation, as loadtest.engine.throughput takes)."""
    import pydoc_data.topics

    ids = llm.tokenizer.encode("\n\n".join(pydoc_data.topics.topics.values()))
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def side(weights: str, smoke: bool = False) -> dict:
    """One side's figures (run in a subprocess of its own)."""
    import torch

    from disagg import LLM, SamplingParams

    sizes = SMOKE if smoke else FULL
    torch.set_num_threads(2)
    llm = LLM(num_kv_blocks=1024, weights=weights)
    figures = {"rss_after_load_mib": _rss_mib()}
    greedy = SamplingParams(temperature=0.0, max_tokens=sizes.decode_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts(llm, 1, 100)[0]}], greedy, use_tqdm=False)  # warm up
    for batch in sizes.batches:
        batch_prompts = [{"prompt_token_ids": p} for p in prompts(llm, batch, 100)]
        started = time.perf_counter()
        llm.generate(batch_prompts, greedy, use_tqdm=False)
        figures[f"decode_tok_s@{batch}"] = batch * sizes.decode_tokens / (time.perf_counter() - started)
    long = [{"prompt_token_ids": p} for p in prompts(llm, sizes.prefill_prompts, sizes.prefill_len)]
    started = time.perf_counter()
    llm.generate(long, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    figures["prefill_tok_s"] = sizes.prefill_prompts * sizes.prefill_len / (time.perf_counter() - started)
    check = SamplingParams(temperature=0.0, max_tokens=sizes.agreement_tokens, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts(llm, sizes.agreement_prompts, sizes.agreement_len)],
        check,
        use_tqdm=False,
    )
    figures["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
    figures["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return figures


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run_side(weights: str, smoke: bool) -> dict:
    code = f"import json, {__spec__.name} as b; print(json.dumps(b.side({weights!r}, {smoke!r})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def agreement(reference: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(share of outputs equal to the reference, mean length of the agreeing prefix)."""
    prefixes = []
    for want, have in zip(reference, got):
        n = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        prefixes.append(n)
    return sum(p == len(r) for p, r in zip(prefixes, reference)) / len(reference), sum(prefixes) / len(prefixes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sides", nargs="+", default=["fp32", "auto"])
    p.add_argument("--json")
    p.add_argument("--smoke", action="store_true", help="a few short requests at batch 1 and 2: runs, no figures")
    args = p.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    print(host_line(), flush=True)
    results = {weights: run_side(weights, args.smoke) for weights in args.sides}
    base = results[args.sides[0]]
    for weights, figures in results.items():
        rates = ", ".join(f"{k} {v:.1f}" for k, v in figures.items() if k.endswith("tok_s") or "tok_s@" in k)
        rss = f"RSS after load {figures['rss_after_load_mib']:.0f} MiB, peak {figures['peak_rss_mib']:.0f} MiB"
        print(f"{weights}: {rates}, {rss} (KV cache 1024 blocks included)")
    for weights, figures in list(results.items())[1:]:
        for batch in sizes.batches:
            key = f"decode_tok_s@{batch}"
            print(f"decode ratio {weights}/{args.sides[0]} @{batch}: {figures[key] / base[key]:.2f}")
        print(f"prefill ratio {weights}/{args.sides[0]}: {figures['prefill_tok_s'] / base['prefill_tok_s']:.2f}")
        for rss in ("rss_after_load_mib", "peak_rss_mib"):
            print(f"{rss.removesuffix('_mib')} ratio {weights}/{args.sides[0]}: {figures[rss] / base[rss]:.2f}")
        same, prefix = agreement(base["outputs"], figures["outputs"])
        print(
            f"greedy agreement with {args.sides[0]}: {same:.0%} of {sizes.agreement_prompts} outputs whole, "
            f"mean prefix {prefix:.1f}/{sizes.agreement_tokens}"
        )
    if args.json:
        write_results(args.json, {w: {k: v for k, v in f.items() if k != "outputs"} for w, f in results.items()}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
