"""Sliding windows in the paged cache (issue 49): for one long prompt handed from a PREFILL to a
DECODE worker, the KV bytes moved and the decode-side blocks held, on a windowed shape against
the same shape with full attention.

The shapes are `random:tiny-mistral` (Mistral-7B-v0.1's layout at a tiny width: 4 layers, 8
query heads over 2 KV heads, head dim 16, a 4,096-token window on every layer) and
`random:tiny-mistral-global` (the same, every layer global), so the run takes seconds on a CPU.
The two workers run in this process over the in-process transport (packed messages, or by
reference with --by-reference), as tests/unit/test_window_transfer.py does. Bytes are those the
endpoints count (num_bytes_total, the kv_transfer_bytes_total metric's source); blocks are the
decode instance's, after the reservation and at their most while it decodes. The prefill's
chunks are whole budgets of 512 tokens (fair prefill off), which end on a block: a chunk that
ends inside a block sends that block again with the next one, and fair prefill's work cap cuts
this narrow shape's prompt into chunks that do (about a tenth more bytes, on both sides).

The ratio is the shape's window against its prompt, so it holds for Mistral-7B-v0.1 itself: its
KV is 128 KiB a token in bf16, and the script prints what the same prompt moves there.

    .venv/bin/python -m loadtest.kv.sliding_window                 # an 8,000-token prompt
    .venv/bin/python -m loadtest.kv.sliding_window --smoke         # a check: 5,000 tokens
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from disagg import EngineConfig, SamplingParams
from disagg.bench.results import host_line, write_results
from disagg.decode_worker.role import DecodeRole
from disagg.engine.model_shapes import named_shapes
from disagg.kv_transfer.inproc import InProcessHub, InProcessTransport
from disagg.prefill_worker.role import PrefillRole

WINDOWED, GLOBAL = "random:tiny-mistral", "random:tiny-mistral-global"
BLOCK_SIZE = 16
BUDGET = 512  # tokens a prefill step computes (chunks of a long prompt)
MISTRAL_7B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16


def measure(model: str, prompt: list[int], max_tokens: int, by_reference: bool) -> dict:
    """One request through a PREFILL and a DECODE worker: bytes moved, decode blocks held."""
    hub = InProcessHub()
    config = dict(
        model=model,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=BUDGET,
        long_prefill_token_threshold=0,
    )
    blocks = -(-(len(prompt) + max_tokens) // BLOCK_SIZE) + 8
    prefill = PrefillRole(
        EngineConfig(**config, num_kv_blocks=blocks, kv_shared_memory=by_reference),
        InProcessTransport("prefill-0", hub),
        kv_timeout=60.0,
    )
    decode = DecodeRole(
        EngineConfig(**config, num_kv_blocks=blocks), InProcessTransport("decode-0", hub), kv_timeout=60.0
    )
    try:
        return _run(prefill, decode, prompt, max_tokens)
    finally:
        prefill.close()
        decode.close()


def _run(prefill: PrefillRole, decode: DecodeRole, prompt: list[int], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    reservation = decode.reserve("r", prompt, params, prefill.kv_layout())
    reserved = decode.engine.block_manager.num_used_blocks
    prefill.prefill("r", prompt, params)
    prefill.set_kv_targets("r", reservation)
    tokens, peak = [], 0
    while not (prefill.is_idle() and decode.is_idle()):
        prefill.step()
        tokens += [t for out in decode.step() for t in out.new_token_ids]
        peak = max(peak, decode.engine.block_manager.num_used_blocks)
        if time.perf_counter() - started > 600:
            raise TimeoutError("the request did not finish in 10 minutes")
    return {
        "kv_bytes_moved": decode.receiver.num_bytes_total,
        "kv_bytes_sent": prefill.sender.num_bytes_total,
        "decode_blocks_reserved": reserved,
        "decode_blocks_peak": peak,
        "prefill_blocks_peak": prefill.engine.block_manager.peak_num_used_blocks,
        "tokens": tokens,
        "seconds": time.perf_counter() - started,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--by-reference", action="store_true", help="the prefill cache in shared memory (KV_REF)")
    parser.add_argument("--smoke", action="store_true", help="a quick check: a 5,000-token prompt, 4 tokens out")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompt_tokens, args.max_tokens = 5000, 4
    torch.set_num_threads(1)
    print(host_line(), flush=True)
    prompt = torch.randint(3, 512, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    window = named_shapes()["tiny-mistral"].sliding_window
    windowed, full = (measure(m, prompt, args.max_tokens, args.by_reference) for m in (WINDOWED, GLOBAL))
    print(f"shape: {WINDOWED} (window {window} on every layer) against {GLOBAL}; {BLOCK_SIZE}-token blocks")
    print(f"prompt tokens: {args.prompt_tokens}; transfer: {'by reference' if args.by_reference else 'packed'}")
    for name, run in (("windowed", windowed), ("full attention", full)):
        print(
            f"{name}: KV bytes moved {run['kv_bytes_moved']}; decode blocks reserved {run['decode_blocks_reserved']}, "
            f"peak {run['decode_blocks_peak']}; prefill blocks peak {run['prefill_blocks_peak']} ({run['seconds']:.1f} s)"
        )
    bytes_ratio = windowed["kv_bytes_moved"] / full["kv_bytes_moved"]
    print(f"KV bytes moved ratio windowed/full: {bytes_ratio:.3f}")
    print(f"decode blocks held ratio windowed/full: {windowed['decode_blocks_peak'] / full['decode_blocks_peak']:.3f}")
    full_mib = args.prompt_tokens * MISTRAL_7B_KV_BYTES_PER_TOKEN / 2**20
    print(
        f"Mistral-7B-v0.1, bf16, the same prompt: {bytes_ratio * full_mib:.0f} MiB moved instead of {full_mib:.0f} MiB"
    )
    if args.json:
        write_results(args.json, {"prompt_tokens": args.prompt_tokens, "windowed": windowed, "full": full}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
