"""KV-transfer benchmark (issue 3), all in one run:

  (a) raw torch.distributed send/recv between two Ray actors, one contiguous tensor;
  (b) the KV of a 1024-token prompt in Llama-3-8B's geometry (32 layers, 8 KV heads, head dim
      128) through the protocol (per-layer messages, DONE, ACK) from scattered blocks into
      scattered blocks: GB/s and its ratio to (a), target >= 0.9. Two ways on CPU: by reference
      (the two actors share a host, the prefill cache is in shared memory and the receiver
      copies the blocks out of it: what the service does there), and packed into messages over
      gloo (what it does between hosts, or with DISAGG_KV_SHARED_MEMORY=0);
  (c) a prefill of the default model with layer-wise streaming to a decode actor, against the
      same prefill alone: time ratio, target <= 1.10 (the transfer hides behind compute).

    .venv/bin/python -m loadtest.kv.transfer [--dtype float32|bfloat16] [--device cpu|cuda] [--repeats 5]
    .venv/bin/python -m loadtest.kv.transfer --tokens 32 --layers 2 --heads 2 --head-dim 16 --repeats 1  # a check

On a GPU machine use --device cuda: the transport then uses NCCL.
"""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import statistics
import sys
import time
from types import SimpleNamespace

import ray
import torch
from ray import cloudpickle

from disagg.bench.results import host_line, write_results
from disagg.config import DEFAULT_KV_TRANSPORT
from disagg.engine.kv_cache import KVCache
from disagg.kv_transfer.factory import make_transport
from disagg.kv_transfer.layout import KVTarget
from disagg.kv_transfer.receiver import KVReceiver
from disagg.kv_transfer.sender import KVSender
from loadtest.kv.transfer_actors import measure_raw_bandwidth

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The KV measured: Llama-3-8B's by default, of a `tokens`-token prompt."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    tokens: int = 1024

    @property
    def num_blocks(self) -> int:
        return self.tokens // self.block_size

    def num_bytes(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * self.tokens * element


@ray.remote(num_cpus=0)
class KVEndpointActor:
    """A KV cache of the geometry with a sender and a receiver on one transport."""

    def __init__(
        self, worker_id: str, key: bytes, num_blocks: int, geometry: Geometry, dtype: torch.dtype, device: str,
        shared: bool, layer_gap_ms: float = 0.0,
    ):  # fmt: skip
        torch.set_num_threads(1)
        g = self.geometry = geometry
        self.layer_gap_s = layer_gap_ms / 1e3
        self.cache = KVCache(
            g.layers, num_blocks, g.block_size, g.kv_heads, g.head_dim, dtype, torch.device(device), shared=shared
        )
        self.cache.tensor.normal_()
        transport = make_transport(DEFAULT_KV_TRANSPORT, worker_id, key, device=device)
        self.sender = KVSender(transport, timeout=120)
        self.receiver = KVReceiver(transport, timeout=120)
        for endpoint in (self.sender, self.receiver):
            endpoint.register_kv_cache(self.cache)

    def address(self) -> str:
        return self.sender.address()

    def expect(self, request_id: str, block_ids: list[int], sources: dict) -> int:
        return self.receiver.expect(request_id, block_ids, sources)

    def stream(self, request_id: str, block_ids: list[int], target: KVTarget) -> tuple[float, float, int]:
        """Hand every layer of the blocks to the sender as the model would (one call per layer),
        then DONE; returns seconds from the first layer to the receiver's ACK, seconds from the
        last layer to the ACK (what the transfer adds after the compute), and the protocol
        messages the transfer took (both ways: the sender sends or receives every one of them)."""
        messages_before = self.sender.num_messages_total
        chunk = SimpleNamespace(
            request=SimpleNamespace(request_id=request_id, block_ids=block_ids),
            start=0,
            num_new_tokens=len(block_ids) * self.geometry.block_size,
            samples=True,  # a whole prompt: its first token is sampled at the end of this step
            generates=False,
        )
        self.sender.add(request_id, [target])
        for layer in range(self.geometry.layers):
            time.sleep(self.layer_gap_s)  # the layer's compute, during which the channel's thread runs
            self.sender.save_kv_layer(layer, [chunk])
        self.sender.forward_done([chunk])
        computed = time.perf_counter()
        self.sender.finish(request_id, first_token=1)
        seconds = _wait(self.sender).seconds
        return seconds, time.perf_counter() - computed, self.sender.num_messages_total - messages_before

    def received(self):
        return _wait(self.receiver)


def _wait(endpoint, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        results = endpoint.poll()
        if results:
            assert results[0].ok, results[0].error
            return results[0]
        time.sleep(0.0005)
    raise TimeoutError("transfer did not finish")


@dataclasses.dataclass(frozen=True)
class ProtocolFigures:
    gbps: float  # KV bytes over the median transfer's seconds
    num_bytes: int
    messages: int  # protocol messages of one transfer of the geometry's tokens
    fixed_cost_ms: float  # a one-block transfer's last layer to its ACK (median): what every transfer adds


def protocol_bandwidth(
    geometry: Geometry, dtype: torch.dtype, device: str, repeats: int, by_reference: bool, layer_gap_ms: float
) -> ProtocolFigures:
    """`layer_gap_ms`: the sender gets each layer this long after the one before, as from a model
    computing them (with none, a burst of layers coalesces into few messages whatever the protocol)."""
    num_blocks = geometry.num_blocks
    total = 4 * num_blocks
    key = secrets.token_bytes(32)  # both ends are one deployment's
    src, dst = (
        KVEndpointActor.remote("p-bench", key, total, geometry, dtype, device, by_reference, layer_gap_ms),
        KVEndpointActor.remote("d-bench", key, total, geometry, dtype, device, False),
    )
    src_addr, dst_addr = ray.get([src.address.remote(), dst.address.remote()])
    kind = "by reference" if by_reference else "packed"

    def transfer(request_id: str, src_blocks: list[int], dst_blocks: list[int]) -> tuple[float, float, int]:
        transfer_id = ray.get(dst.expect.remote(request_id, dst_blocks, {"p-bench": src_addr}))
        target = KVTarget("d-bench", dst_addr, transfer_id, dst_blocks, (0, geometry.layers), (0, geometry.kv_heads))
        received = dst.received.remote()
        figures = ray.get(src.stream.remote(request_id, src_blocks, target))
        ray.get(received)
        return figures

    seconds, messages = [], []
    for r in range(repeats + 1):  # the first is a warm-up (connects the pair)
        src_blocks = list(range(r % 4, total, 4))[:num_blocks]  # every 4th block: scattered
        dst_blocks = list(range(total - 1 - r % 4, -1, -4))[:num_blocks]
        s, _, m = transfer(f"r{r}", src_blocks, dst_blocks)
        seconds.append(s)
        messages.append(m)
        print(f"  protocol transfer {r} ({kind}): {s:.3f} s, {m} messages", flush=True)
    # The fixed cost: what a one-block transfer adds after its last layer is computed (many, the median).
    small = [transfer(f"f{r}", [r % total], [total - 1 - r % total])[1] for r in range(5 * repeats + 1)]
    fixed_cost_ms = statistics.median(small[1:]) * 1e3
    print(f"  one-block transfer ({kind}): median {fixed_cost_ms:.2f} ms", flush=True)
    for actor in (src, dst):
        ray.kill(actor)
    num_bytes = geometry.num_bytes(dtype)
    return ProtocolFigures(
        num_bytes / statistics.median(seconds[1:]) / 1e9, num_bytes, statistics.median(messages[1:]), fixed_cost_ms
    )


@ray.remote(num_cpus=0)
class DecodeSide:
    def __init__(self, worker_id: str, key: bytes):
        torch.set_num_threads(1)
        from disagg.config import EngineConfig
        from disagg.decode_worker.role import DecodeRole

        transport = make_transport(DEFAULT_KV_TRANSPORT, worker_id, key)
        self.worker = DecodeRole(EngineConfig(num_kv_blocks=256), transport, kv_timeout=120)

    def address(self) -> str:
        return self.worker.address()

    def reserve(self, request_id, prompt, params, prefill):
        return self.worker.reserve(request_id, prompt, params, prefill)

    def drain(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.worker.is_idle() and time.monotonic() < deadline:
            self.worker.step()
            time.sleep(0.001)


def streaming_overhead(repeats: int, prompt_len: int = 1024) -> tuple[float, float, float, int]:
    """Median prefill seconds alone and with layer-wise streaming, their ratio, and the median
    protocol messages of a streamed prompt (with a real model's pace between layers)."""
    from disagg.config import EngineConfig
    from disagg.prefill_worker.role import PrefillRole
    from disagg.request import SamplingParams

    torch.set_num_threads(1)
    key = secrets.token_bytes(32)  # both ends are one deployment's
    transport = make_transport(DEFAULT_KV_TRANSPORT, "p-stream", key)
    prefill = PrefillRole(EngineConfig(num_kv_blocks=256, max_num_batched_tokens=512), transport, kv_timeout=120)
    decode = DecodeSide.remote("d-stream", key)
    cfg = prefill.engine.model_config
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    alone, streamed, messages = [], [], []
    for r in range(repeats + 1):
        for streaming in (False, True):
            prompt[0] = r * 2 + streaming  # a new prompt each time: no prefix-cache hits
            request_id = f"{'s' if streaming else 'a'}{r}"
            if streaming:
                reservation = ray.get(decode.reserve.remote(request_id, prompt, params, prefill.kv_layout()))
                draining = decode.drain.remote()
            messages_before = prefill.sender.num_messages_total
            start = time.perf_counter()
            prefill.prefill(request_id, prompt, params)
            if streaming:
                prefill.set_kv_targets(request_id, reservation)  # in force from the first layer on
            while prefill.engine.has_unfinished_requests():
                prefill.step()
            elapsed = time.perf_counter() - start
            if not streaming:
                prefill.abort(request_id)  # no targets will come: free its blocks now
            while not prefill.is_idle():  # acknowledgements, outside the timed part
                prefill.step()
                time.sleep(0.001)
            if streaming:
                ray.get(draining)
            if r > 0:  # the first round warms up
                (streamed if streaming else alone).append(elapsed)
                if streaming:
                    messages.append(prefill.sender.num_messages_total - messages_before)
    ray.kill(decode)
    prefill.close()
    a, s = statistics.median(alone), statistics.median(streamed)
    return a, s, s / a, int(statistics.median(messages))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    default = Geometry()
    parser.add_argument("--tokens", type=int, default=default.tokens, help="of the KV moved, and of the prefill (c)")
    parser.add_argument("--layers", type=int, default=default.layers)
    parser.add_argument("--heads", type=int, default=default.kv_heads, help="KV heads")
    parser.add_argument("--head-dim", type=int, default=default.head_dim)
    parser.add_argument("--block-size", type=int, default=default.block_size)
    parser.add_argument(
        "--layer-gap-ms",
        type=float,
        default=2.0,
        help="(b): each layer reaches the sender this long after the previous one, as from a model "
        "(2 ms: a layer of Llama-3-8B's 1,024-token prefill on an H100-class GPU)",
    )
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.tokens < args.block_size:
        parser.error("need --repeats >= 1 and --tokens >= --block-size")
    geometry = Geometry(args.layers, args.heads, args.head_dim, args.block_size, args.tokens)
    dtype = getattr(torch, args.dtype)
    print(host_line(), flush=True)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    by_reference = args.device == "cpu"  # a cache on a GPU is never in shared host memory
    gap = args.layer_gap_ms
    ref = protocol_bandwidth(geometry, dtype, args.device, args.repeats, True, gap) if by_reference else None
    packed = protocol_bandwidth(geometry, dtype, args.device, args.repeats, False, gap)
    num_bytes = packed.num_bytes
    raw_gbps = measure_raw_bandwidth(num_bytes, dtype, args.repeats)
    print(f"raw: {raw_gbps:.2f} GB/s", flush=True)
    alone, streamed, ratio, streamed_messages = streaming_overhead(args.repeats, args.tokens)
    ray.shutdown()
    print(
        f"\nKV of {geometry.tokens} tokens, {geometry.layers} layers x {geometry.kv_heads} KV heads x {geometry.head_dim} (Llama-3-8B's by default), {args.dtype}, {num_bytes / 2**20:.1f} MiB, {args.device}; (b) layers {args.layer_gap_ms:g} ms apart"
    )
    print(f"(a) raw send/recv, one contiguous tensor: {raw_gbps:6.2f} GB/s")
    for name, figures in (("by reference (same host)", ref), ("packed messages over the transport", packed)):
        if figures is None:
            continue
        print(
            f"(b) protocol, scattered blocks, {name}: {figures.gbps:6.2f} GB/s   ratio to raw {figures.gbps / raw_gbps:.3f} (target >= 0.9)"
        )
        print(
            f"    messages per {geometry.tokens}-token transfer: {figures.messages}   fixed cost per transfer (one block, last layer to ACK): {figures.fixed_cost_ms:.2f} ms"
        )
    print(
        f"(c) default-model prefill of {args.tokens} tokens: alone {alone * 1e3:.0f} ms, streaming its KV {streamed * 1e3:.0f} ms   ratio {ratio:.3f} (target <= 1.10); {streamed_messages} messages per prompt"
    )
    if args.json:
        protocol = {name: dataclasses.asdict(f) for name, f in (("by_reference", ref), ("packed", packed)) if f}
        figures = {"raw_gbps": raw_gbps, "protocol": protocol, "prefill_alone_s": alone, "prefill_streamed_s": streamed}
        write_results(args.json, {**figures, "prefill_ratio": ratio, "streamed_messages": streamed_messages}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
