"""KV by reference between two processes on one host, through the real protocol (issue 41).

A prefill process (a child of this one) holds a shared KV cache (CUDA IPC on a GPU, shared
memory on CPU) and streams a prompt's KV layer by layer with KVSender over the configured transport;
this process receives it with KVReceiver into scattered blocks of its own cache. Headers and
block references travel over gloo; the KV itself is copied once, straight from the sender's
cache into the receiver's (NCCL refuses two ranks on one GPU, and needs no copy here anyway).

Prints the protocol's GB/s against a raw copy of the same bytes on the same device, and with
--check verifies every block (exit 1 on a mismatch): tests/gpu runs it that way.

    python -m loadtest.kv.ipc --device cuda                      # Llama-3-8B KV of 1024 tokens
    python -m loadtest.kv.ipc --device cuda --tokens 64 --layers 2 --check
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

from disagg.auth import new_key
from disagg.bench.results import host_line
from disagg.config import DEFAULT_KV_TRANSPORT
from disagg.engine.kv_cache import KVCache
from disagg.kv_transfer.factory import make_transport
from disagg.kv_transfer.layout import KVTarget
from disagg.kv_transfer.receiver import KVReceiver
from disagg.kv_transfer.sender import KVSender

TIMEOUT_S = 60.0


def cache_of(args, shared: bool) -> KVCache:
    num_blocks = 2 * -(-args.tokens // args.block_size) + 8
    dtype = getattr(torch, args.dtype)
    return KVCache(
        args.layers, num_blocks, args.block_size, args.heads, args.head_dim, dtype, torch.device(args.device), shared
    )


def fill(cache: KVCache, seed: int) -> None:
    """Values that differ in every position, layer and head (so a misplaced block shows)."""
    t = cache.tensor
    values = torch.arange(t.numel(), device=t.device, dtype=torch.float64).remainder_(65521).add_(seed)
    t.copy_(values.view(t.shape).to(t.dtype))


def source_blocks(args) -> list[int]:
    n = -(-args.tokens // args.block_size)
    return [2 * i + 1 for i in range(n)]  # scattered: every other block


def dest_blocks(args) -> list[int]:
    n = -(-args.tokens // args.block_size)
    return [2 * i for i in reversed(range(n))]  # scattered, in the other order


def wait_result(endpoint, timeout: float = TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        results = endpoint.poll()
        if results:
            return results[0]
        time.sleep(0.0005)
    raise TimeoutError("no transfer result")


# ---- the prefill side (child process) ----------------------------------------------------------
def run_sender(args) -> None:
    cache = cache_of(args, shared=True)
    fill(cache, seed=1)
    sender = KVSender(
        make_transport(DEFAULT_KV_TRANSPORT, "p", bytes.fromhex(args.key), device=args.device), timeout=TIMEOUT_S
    )
    sender.register_kv_cache(cache)
    print(sender.address(), flush=True)
    sender.transport.connect("d", args.peer, TIMEOUT_S)
    src = source_blocks(args)
    for line in sys.stdin:
        request_id, transfer_id = line.split()
        target = KVTarget("d", args.peer, int(transfer_id), dest_blocks(args), (0, args.layers), (0, args.heads))
        sender.add(request_id, [target])
        chunk = SimpleNamespace(
            request=SimpleNamespace(request_id=request_id, block_ids=src),
            start=0,
            num_new_tokens=args.tokens,
            samples=True,
            generates=False,
        )
        for layer in range(args.layers):
            sender.save_kv_layer(layer, [chunk])
        sender.forward_done([chunk])
        sender.finish(request_id, first_token=7)
        result = wait_result(sender)
        print(f"{int(result.ok)} {result.error or ''}", flush=True)
    sender.close()


# ---- the decode side (this process) ------------------------------------------------------------
def run(args) -> int:
    key = new_key()
    receiver = KVReceiver(make_transport(DEFAULT_KV_TRANSPORT, "d", key, device=args.device), timeout=TIMEOUT_S)
    cache = cache_of(args, shared=False)
    receiver.register_kv_cache(cache)
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            __spec__.name,
            "--role",
            "prefill",
            "--key",
            key.hex(),
            "--peer",
            receiver.address(),
        ]
        + _geometry_args(args),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        sender_address = child.stdout.readline().strip()
        receiver.transport.connect("p", sender_address, TIMEOUT_S)
        path = receiver.transport.path_to("p")  # (both caches on one device: the same path both ways)
        by_reference = path is not None and path.by_reference
        expected = reference_blocks(args)
        seconds, mismatches = [], 0
        for i in range(args.repeats + 1):  # the first is a warm-up (maps the peer's cache)
            cache.tensor.zero_()
            dst = dest_blocks(args)
            transfer_id = receiver.expect(f"r{i}", dst, {"p": sender_address})
            started = time.perf_counter()
            child.stdin.write(f"r{i} {transfer_id}\n")
            child.stdin.flush()
            result = wait_result(receiver)
            elapsed = time.perf_counter() - started
            ok_line = child.stdout.readline().strip()
            if not (result.ok and result.first_token == 7 and ok_line.startswith("1")):
                print(f"transfer {i} failed: receiver {result}, sender {ok_line!r}")
                return 1
            got = cache.tensor.index_select(3, torch.tensor(dst, device=cache.tensor.device))
            mismatches += int(not torch.equal(got, expected))
            if i:
                seconds.append(elapsed)
        report(args, cache, seconds, by_reference, mismatches)
        return 1 if (args.check and mismatches) else 0
    finally:
        child.stdin.close()
        child.wait(timeout=TIMEOUT_S)
        receiver.close()


def reference_blocks(args) -> torch.Tensor:
    source = cache_of(args, shared=False)
    fill(source, seed=1)
    return source.tensor.index_select(3, torch.tensor(source_blocks(args), device=source.tensor.device))


def raw_copy_seconds(args, num_bytes: int) -> float:
    """One contiguous copy of the same bytes on the same device (the floor of any transfer)."""
    device = torch.device(args.device)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(args.repeats + 1):
        _sync(device)
        started = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def report(args, cache: KVCache, seconds: list[float], by_reference: bool, mismatches: int) -> None:
    n = len(dest_blocks(args))
    num_bytes = cache.slice_bytes(args.layers, (0, args.heads), n)
    protocol_s = statistics.median(seconds)
    raw_s = raw_copy_seconds(args, num_bytes)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"device: {name}; KV of {args.tokens} tokens, {args.layers} layers x {args.heads} heads x {args.head_dim}, {args.dtype}"
    )
    print(f"path: {'by reference (one copy from the sender cache)' if by_reference else 'packed messages'}")
    print(f"bytes: {num_bytes / 2**20:.1f} MiB; blocks {n}; repeats {len(seconds)}")
    print(f"protocol: {protocol_s * 1e3:.3f} ms ({num_bytes / protocol_s / 1e9:.1f} GB/s)")
    print(f"raw copy: {raw_s * 1e3:.3f} ms ({num_bytes / raw_s / 1e9:.1f} GB/s)")
    print(f"protocol/raw bandwidth: {raw_s / protocol_s:.3f}")
    print(f"mismatched transfers: {mismatches}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _geometry_args(args) -> list[str]:
    return [
        "--device", args.device, "--dtype", args.dtype, "--tokens", str(args.tokens), "--layers", str(args.layers),
        "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--block-size", str(args.block_size),
    ]  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check", action="store_true", help="exit 1 when any block arrives wrong")
    p.add_argument("--role", choices=["prefill"], help=argparse.SUPPRESS)
    p.add_argument("--key", help=argparse.SUPPRESS)
    p.add_argument("--peer", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    torch.set_num_threads(1)
    args = parse_args(argv)
    if args.role == "prefill":
        run_sender(args)
        return 0
    print(host_line(), flush=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
