"""Peer block fetch (issue 54): a prompt's prefix computed by a prefill instance, against the same
blocks fetched from a peer instance that holds them (disagg.kv_transfer.peer_blocks), then the
prefill of what is left; both instances in this process on 127.0.0.1, over torch.distributed.

    .venv/bin/python -m loadtest.kv.peer_fetch [--tokens 1024] [--repeats 3] [--packed]
    .venv/bin/python -m loadtest.kv.peer_fetch --model random:tiny --tokens 64 --repeats 1  # a check

By reference (the default on one host: the holder's cache is in shared memory and the fetching
instance copies the blocks out of it), or `--packed` (over gloo, as between hosts). The first
fetch of a pair also builds the pair and maps the holder's cache: the medians leave it out.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from disagg.bench.results import host_line
from disagg.config import EngineConfig
from disagg.kv_transfer.torch_dist import TorchDistTransport
from disagg.prefill_worker.role import PrefillRole
from disagg.request import SamplingParams

KEY = b"peer-fetch-benchmark-key"
GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def transport(name: str) -> TorchDistTransport:
    return TorchDistTransport(name, KEY, "127.0.0.1")


def prefill_s(role: PrefillRole, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """The prompt's prefill on `role`, stepped here: (seconds, its cached tokens)."""
    started = time.perf_counter()
    first = role.prefill(request_id, prompt, GREEDY)
    while not first.done():
        role.step()
    role.abort(request_id)  # its KV goes nowhere
    return time.perf_counter() - started, first.result().num_cached_tokens


def fetch_s(holder: PrefillRole, fetcher: PrefillRole, fetch_id: str, prompt: list[int], num_blocks: int) -> float:
    started = time.perf_counter()
    slot = fetcher.reserve_peer_import(fetch_id, prompt, num_blocks, holder.peer_export_layout())
    done = holder.export_prefix(fetch_id, prompt, num_blocks, slot)
    while not done.done():
        holder.peers.settle()
        fetcher.peers.settle()
        time.sleep(0.0002)
    fetcher.peers.settle()  # in its prefix cache now
    if not done.result():
        raise RuntimeError("the fetch failed")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the engine's model (default: the default model)")
    parser.add_argument("--tokens", type=int, default=1024, help="the prefix's tokens (whole blocks)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--packed", action="store_true", help="over gloo, not by reference")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = {"model": args.model} if args.model else {}
    config = EngineConfig(**model, dtype="float32", num_kv_blocks=4 * (args.tokens // 16 + 2),
                          max_num_batched_tokens=args.tokens + 16, kv_shared_memory=not args.packed)  # fmt: skip
    holder = PrefillRole(config, transport("holder"), export_transport=transport("holder-export"), kv_timeout=60)
    fetcher = PrefillRole(config, transport("fetcher"), import_transport=transport("fetcher-import"), kv_timeout=60)
    print(host_line())
    rows = []
    for i in range(args.repeats + 1):
        vocab = holder.engine.model_config.vocab_size
        prompt = torch.randint(3, vocab, (args.tokens + 1,), generator=torch.Generator().manual_seed(i)).tolist()
        computed, _ = prefill_s(holder, f"compute-{i}", prompt)
        fetched = fetch_s(holder, fetcher, f"fetch-{i}", prompt, args.tokens // 16)
        rest, cached = prefill_s(fetcher, f"rest-{i}", prompt)
        print(f"prefix {args.tokens} tokens: computed {computed * 1e3:.0f} ms; fetched {fetched * 1e3:.1f} ms, "
              f"then the rest's prefill {rest * 1e3:.0f} ms ({cached} cached)" + (" (pairing)" if i == 0 else ""))  # fmt: skip
        rows.append((computed, fetched)) if i else None
    mib = fetcher.peers.imports.fetched_bytes / (args.repeats + 1) / 2**20
    computed, fetched = (statistics.median(r[k] for r in rows) for k in (0, 1))
    way = "packed over gloo" if args.packed else "by reference"
    print(f"peer fetch {way}: {mib:.2f} MiB in {fetched * 1e3:.1f} ms (median) against {computed * 1e3:.0f} ms "
          f"computing it: {computed / fetched:.1f}x")  # fmt: skip
    holder.close()
    fetcher.close()
    for thread in threading.enumerate():  # the mapping of the holder's cache may still touch its pages
        if thread.name == "kv-map-pages":
            thread.join(60)


if __name__ == "__main__":
    main()
