"""Memory of a decode worker with the default model: weights kept quantized against float32, and
against llama.cpp's server holding the same KV capacity (issue 38).

Each side is served alone, as an operator starts it, and its resident memory (RSS) read once it
has answered a few requests:

- `disagg serve`'s default deployment (1 prefill + 1 decode worker) with `engine.weights` auto
  (the GGUF's Q4_1 blocks kept as int4, its Q8_0 embedding as int8, shared with the vocabulary
  projection) and then fp32 (the GGUF dequantized); each worker with a KV cache of
  --kv-tokens tokens. The figure is the decode worker's RSS (the prefill worker's is printed too).
- `llama-server` (built once from source, loadtest/peers/llamacpp.py) with one slot of --kv-tokens
  tokens of context, 2 threads.

The KV caches hold the same number of tokens, not the same bytes: ours is float32 (the model's
dtype), llama.cpp's float16; each side's KV bytes are printed next to its RSS.

    .venv/bin/python -m loadtest.service.memory [--json PATH] [--skip-llamacpp]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

import psutil

from disagg.bench.launcher import Deployment, add_config_argument, free_port
from disagg.bench.results import host_line, write_results
from disagg.client import DisaggClient, generate_request
from disagg.engine.loader import default_gguf_path

BLOCK_SIZE = 16
PROMPT = "Explain, in a few sentences, why the sky is blue during the day and red at sunset."


def serve_side(weights: str, kv_tokens: int, requests: int, base: str | None = None) -> dict:
    engine = {"weights": weights, "num_kv_blocks": kv_tokens // BLOCK_SIZE}
    with Deployment({"engine": engine, "replan": False, "calibration_s": 0}, base=base) as deployment:
        with DisaggClient(deployment.address) as client:
            for _ in range(requests):
                request = generate_request(prompt=PROMPT, temperature=0.0, max_tokens=64, ignore_eos=True)
                client.generate(request, timeout=300)
            roles = _roles_by_port(client)
        return {kind: _rss_mib(pid) for pid, kind in _workers(deployment, roles).items()}


def _roles_by_port(client: DisaggClient) -> dict[int, str]:
    """KV port -> role, of every instance the frontend knows."""
    instances = [i for pool in client.cluster_status().pools for i in pool.instances]
    return {int(i.kv_address.rsplit(":", 1)[1]): i.role for i in instances if ":" in i.kv_address}


def _workers(deployment: Deployment, roles: dict[int, str]) -> dict[int, str]:
    """pid -> "decode" or "prefill": the role of the instance whose KV port the process listens on
    (every worker process is a ray::WorkerActor, whichever its role)."""
    named = {}
    for pid, name in deployment.workers().items():
        try:
            ports = {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == "LISTEN"}
        except psutil.Error:
            ports = set()
        named[pid] = next((roles[p] for p in ports if p in roles), name)
    return named


def llamacpp_side(kv_tokens: int, threads: int, requests: int) -> dict:
    from loadtest.peers import llamacpp

    binary = llamacpp.binaries()["llama-server"]
    with tempfile.TemporaryDirectory() as tmp:
        server = llamacpp.LlamaServer(binary, default_gguf_path(), free_port(), slots=1, slot_context=kv_tokens,
                                      threads=threads, log=Path(tmp) / "llama-server.log")  # fmt: skip
        with server:
            body = json.dumps({"prompt": PROMPT, "max_tokens": 64, "temperature": 0}).encode()
            for _ in range(requests):
                post = urllib.request.Request(
                    f"{server.url}/v1/completions", body, {"Content-Type": "application/json"}
                )
                urllib.request.urlopen(post, timeout=300).read()
            return {"llama-server": _rss_mib(server.process.pid)}


def _rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def kv_mib(kv_tokens: int, bytes_per_value: int) -> float:
    """SmolLM2-135M's KV: 30 layers x (K, V) x 3 KV heads x 64 dims per token."""
    return kv_tokens * 30 * 2 * 3 * 64 * bytes_per_value / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV capacity of each side, in tokens")
    p.add_argument("--requests", type=int, default=3, help="answered before RSS is read")
    p.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--json", help="write the figures here")
    add_config_argument(p)
    args = p.parse_args(argv)
    print(host_line(), flush=True)
    figures: dict = {"kv_tokens": args.kv_tokens, "kv_mib": {"disagg (float32)": kv_mib(args.kv_tokens, 4)}}
    for weights in ("auto", "fp32"):
        figures[weights] = serve_side(weights, args.kv_tokens, args.requests, args.config)
        print(f"disagg weights={weights}: RSS MiB {figures[weights]}", flush=True)
    if not args.skip_llamacpp:
        figures["kv_mib"]["llama.cpp (float16)"] = kv_mib(args.kv_tokens, 2)
        figures["llamacpp"] = llamacpp_side(args.kv_tokens, args.threads, args.requests)
        print(f"llama.cpp: RSS MiB {figures['llamacpp']}", flush=True)
    decode = figures["auto"]["decode"]
    print(f"decode worker RSS, weights auto / fp32: {decode / figures['fp32']['decode']:.2f}")
    if not args.skip_llamacpp:
        print(f"decode worker RSS / llama-server RSS: {decode / figures['llamacpp']['llama-server']:.2f}")
    print(f"KV MiB at {args.kv_tokens} tokens: {figures['kv_mib']}")
    if args.json:
        write_results(args.json, figures, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
