"""How close the engine's steps come to the GPU's limits (issue 41): decode against memory
bandwidth, prefill against matrix FLOP/s, at a real model's shape with random weights.

- decode: B requests of C context tokens each, every step one token for each; the step reads
  every weight once and each request's KV: bandwidth utilisation = those bytes / step time /
  the GPU's peak (its datasheet figure, and the device-to-device copy measured here);
- prefill: one prompt of T tokens in one step: FLOP utilisation = the step's matrix FLOPs
  (2 per weight per token, plus causal attention) / step time / the datasheet's dense peak.

    python -m loadtest.engine.gpu                               # random:llama3-8b, bf16, on cuda
    python -m loadtest.engine.gpu --device cpu --model random:tiny --dtype float32 --batches 1,4 --prompt-tokens 64 --context 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from disagg import EngineConfig, SamplingParams
from disagg.bench.results import host_line, write_results
from disagg.engine.engine import LLMEngine

# Datasheet peaks (SXM parts): HBM bytes/s and dense bf16 FLOP/s.
PEAKS = {"h100": (3.35e12, 989e12), "h200": (4.8e12, 989e12), "a100": (2.04e12, 312e12)}
DECODE_WARM_UP_STEPS = 2


def datasheet_peaks(device: torch.device) -> tuple[float | None, float | None]:
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device).lower()
    return next((peak for key, peak in PEAKS.items() if key in name), (None, None))


def measured_copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a 1 GiB device-to-device copy (the practical ceiling)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - started)
    return 2 * n / statistics.median(times[1:])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_engine(args, max_seqs: int, budget: int) -> LLMEngine:
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
    )
    return LLMEngine(config)


def weight_bytes(engine: LLMEngine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


def matmul_params(engine: LLMEngine) -> int:
    """Weights a token multiplies through (everything but the embedding lookup; the vocabulary
    projection counts once per sampled row, not per token, and is left out for prefill)."""
    cfg = engine.model_config
    per_layer = sum(p.numel() for n, p in engine.model.layers[0].named_parameters() if p.dim() == 2)
    return per_layer * cfg.num_hidden_layers


def kv_bytes_per_token(engine: LLMEngine) -> int:
    cfg = engine.model_config
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * engine.kv_cache.tensor.element_size()


def decode_step_seconds(engine: LLMEngine, batch: int, context: int, steps: int, seed: int) -> float:
    """Median time of a decode step once `batch` requests of `context` tokens are all decoding."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_WARM_UP_STEPS + steps + 8, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(3, vocab, (context,), generator=g).tolist()
        engine.add_request(f"d{batch}-{i}", prompt_token_ids=ids, sampling_params=params)
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()  # the prefills (and their first decode steps)
    for _ in range(DECODE_WARM_UP_STEPS):  # the batch's first full steps build its kernels
        engine.step()
    times = []
    for _ in range(steps):
        sync(engine.device)
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    for i in range(batch):
        engine.abort_request(f"d{batch}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def prefill_step_seconds(engine: LLMEngine, tokens: int, repeats: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for r in range(repeats + 1):
        ids = torch.randint(3, vocab, (tokens,), generator=g).tolist()
        engine.add_request(f"p{r}", prompt_token_ids=ids, sampling_params=params)
        sync(engine.device)
        started = time.perf_counter()
        engine.step()  # the whole prompt in one step (budget = tokens)
        sync(engine.device)
        times.append(time.perf_counter() - started)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times[1:])


def run(args) -> dict:
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    engine = build_engine(args, max_seqs=max(batches), budget=max(args.prompt_tokens, max(batches) * args.context))
    peak_bw, peak_flops = datasheet_peaks(device)
    copy_bw = measured_copy_bandwidth(device)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.model,
        "dtype": args.dtype,
        "cuda_graphs": engine.runner.decode_graphs is not None,
        "weight_bytes": weight_bytes(engine),
        "peak_bandwidth": peak_bw,
        "measured_copy_bandwidth": copy_bw,
        "peak_flops": peak_flops,
        "decode": [],
    }
    for batch in batches:
        seconds = decode_step_seconds(engine, batch, args.context, args.steps, seed=batch)
        mean_context = args.context + DECODE_WARM_UP_STEPS + args.steps // 2  # of the timed steps
        moved = result["weight_bytes"] + batch * mean_context * kv_bytes_per_token(engine)
        row = {"batch": batch, "context": args.context, "step_ms": seconds * 1e3, "bytes_per_s": moved / seconds}
        row["bandwidth_utilisation"] = moved / seconds / peak_bw if peak_bw else None
        row["of_measured_copy"] = moved / seconds / copy_bw
        result["decode"].append(row)
    seconds = prefill_step_seconds(engine, args.prompt_tokens, args.repeats, seed=1)
    cfg = engine.model_config
    t = args.prompt_tokens
    attention = (
        2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * t * t / 2
    )  # QK^T and PV, causal
    flops = 2 * matmul_params(engine) * t + attention
    result["prefill"] = {
        "tokens": t,
        "step_ms": seconds * 1e3,
        "flops_per_s": flops / seconds,
        "flop_utilisation": flops / seconds / peak_flops if peak_flops else None,
    }
    return result


def report(r: dict) -> None:
    graphs = "decode from CUDA graphs" if r["cuda_graphs"] else "eager"
    print(
        f"device: {r['device']}; model {r['model']} {r['dtype']}; weights {r['weight_bytes'] / 2**30:.2f} GiB; {graphs}"
    )
    peak = f"{r['peak_bandwidth'] / 1e12:.2f} TB/s datasheet, " if r["peak_bandwidth"] else ""
    print(f"memory bandwidth: {peak}{r['measured_copy_bandwidth'] / 1e12:.2f} TB/s measured copy (read + write)")
    for row in r["decode"]:
        util = f"{row['bandwidth_utilisation']:.1%} of datasheet, " if row["bandwidth_utilisation"] else ""
        print(
            f"decode batch {row['batch']:4d} ctx {row['context']}: step {row['step_ms']:8.2f} ms  "
            f"{row['bytes_per_s'] / 1e12:.2f} TB/s  ({util}{row['of_measured_copy']:.1%} of measured copy)"
        )
    p = r["prefill"]
    util = f" ({p['flop_utilisation']:.1%} of datasheet dense peak)" if p["flop_utilisation"] else ""
    print(f"prefill {p['tokens']} tokens: step {p['step_ms']:.2f} ms  {p['flops_per_s'] / 1e12:.1f} TFLOP/s{util}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--batches", default="1,32,64,128", help="decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="prompt tokens of each decoding request")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="the prefill measured")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every step eager")
    p.add_argument("--kv-cache-gib", type=float, default=20.0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(2)
    print(host_line(), flush=True)
    results = run(args)
    report(results)
    if args.out:
        write_results(args.out, results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
