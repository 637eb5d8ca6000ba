"""KV transfer between real Ray actors over torch.distributed (gloo on CPU).

The actors here are thin test wrappers around the real PrefillRole / DecodeRole; each runs
its own loop (`run_until_idle`) so both sides progress at once, as in the service.
"""

from __future__ import annotations

import time

import pytest
import ray
import torch

from disagg import LLM, SamplingParams
from disagg.config import EngineConfig
from disagg.engine.kv_cache import KVCache
from disagg.kv_transfer.receiver import KVReceiver
from disagg.kv_transfer.layout import KVLayout, KVTarget
from disagg.kv_transfer.sender import KVSender
from disagg.kv_transfer.torch_dist import TorchDistTransport
from tests.support import LINK_KEY

KV_TIMEOUT = 10.0


@ray.remote
class PrefillActor:
    def __init__(self, worker_id: str, model: str, **engine_args):
        torch.set_num_threads(1)
        from disagg.prefill_worker.role import PrefillRole

        self.worker = PrefillRole(
            EngineConfig(model=model, **engine_args), TorchDistTransport(worker_id, LINK_KEY), kv_timeout=KV_TIMEOUT
        )
        self.failures: list[str] = []

    def address(self) -> str:
        return self.worker.address()

    def kv_layout(self) -> KVLayout:
        return self.worker.kv_layout()

    def add_request(self, request_id, prompt, params, reservation) -> None:
        self.worker.prefill(request_id, prompt, params)
        self.worker.set_kv_targets(request_id, reservation)  # in force from the first layer on

    def run_until_idle(self, timeout: float) -> list[str]:
        """Step until every request is computed and its transfer ended; returns failed request ids."""
        deadline = time.monotonic() + timeout
        while not self.worker.is_idle() and time.monotonic() < deadline:
            self.worker.step()
            self.failures += [r.request_id for r in self.worker.transfer_results if not r.ok]
            if not self.worker.engine.has_unfinished_requests():
                time.sleep(0.002)  # only waiting for acknowledgements
        return self.failures

    def blocks(self) -> tuple[int, int]:
        return self.worker.engine.num_free_blocks, self.worker.engine.num_total_blocks


@ray.remote
class DecodeActor:
    def __init__(self, worker_id: str, model: str, **engine_args):
        torch.set_num_threads(1)
        from disagg.decode_worker.role import DecodeRole

        self.worker = DecodeRole(
            EngineConfig(model=model, **engine_args), TorchDistTransport(worker_id, LINK_KEY), kv_timeout=KV_TIMEOUT
        )
        self.received_bytes = 0

    def address(self) -> str:
        return self.worker.address()

    def reserve(self, request_id, prompt, params, prefill: KVLayout):
        return self.worker.reserve(request_id, prompt, params, prefill)

    def received_bytes(self) -> int:
        return self.worker.receiver.num_bytes_total

    def run_until_idle(self, timeout: float) -> dict[str, list[int]]:
        finished = {}
        deadline = time.monotonic() + timeout
        while not self.worker.is_idle() and time.monotonic() < deadline:
            for out in self.worker.step():
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
            if not self.worker.engine.scheduler.running:
                time.sleep(0.002)  # only waiting for KV
        return finished

    def blocks(self) -> tuple[int, int]:
        return self.worker.engine.num_free_blocks, self.worker.engine.num_total_blocks


def handshake(prefill, decode, prefill_id: str, decode_id: str, request_id: str, prompt, params) -> None:
    """What the router does: reserve on decode, then hand the prefill the reservation."""
    prefill_layout = ray.get(prefill.kv_layout.remote())
    assert prefill_layout.ranks[0].peer_id == prefill_id
    reservation = ray.get(decode.reserve.remote(request_id, prompt, params, prefill_layout))
    assert reservation is not None and reservation.layout.ranks[0].peer_id == decode_id
    ray.get(prefill.add_request.remote(request_id, prompt, params, reservation))


def disaggregated(model: str, prompts, params, prefill_budget: int, tag: str, **engine_args) -> dict[str, list[int]]:
    prefill = PrefillActor.remote(f"p-{tag}", model, max_num_batched_tokens=prefill_budget, **engine_args)
    decode = DecodeActor.remote(f"d-{tag}", model, **engine_args)
    try:
        for i, p in enumerate(prompts):
            handshake(prefill, decode, f"p-{tag}", f"d-{tag}", f"r{i}", p, params)
        decoded = decode.run_until_idle.remote(120)
        assert ray.get(prefill.run_until_idle.remote(120)) == []
        finished = ray.get(decoded)
        for actor in (prefill, decode):
            free, total = ray.get(actor.blocks.remote())
            assert free == total, "every block is free again"
        return finished
    finally:
        ray.kill(prefill)
        ray.kill(decode)


def random_prompts(lengths, vocab: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def test_tiny_model_disaggregated_equals_colocated(ray_session):
    prompts = random_prompts([3, 20, 64, 130, 300], vocab=500)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in LLM("random:tiny").generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    finished = disaggregated("random:tiny", prompts, params, prefill_budget=64, tag="tiny")
    assert [finished[f"r{i}"] for i in range(len(prompts))] == expected


@pytest.mark.slow
def test_default_model_disaggregated_equals_colocated(ray_session):
    llm = LLM()
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child. " * 12]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    del llm
    finished = disaggregated("smollm2-135m-instruct", prompts, params, prefill_budget=64, tag="smol")
    assert [finished[f"r{i}"] for i in range(len(prompts))] == expected


@ray.remote
class CacheActor:
    """A bare KV cache with a sender or receiver: the byte-exact block transfer, no model."""

    def __init__(self, worker_id: str, num_blocks: int, fill_seed: int | None, shared: bool = False):
        torch.set_num_threads(1)
        self.cache = KVCache(
            num_layers=4,
            num_blocks=num_blocks,
            block_size=16,
            num_kv_heads=8,
            head_dim=128,
            dtype=torch.float32,
            device=torch.device("cpu"),
            shared=shared,
        )
        if fill_seed is not None:
            self.cache.tensor.copy_(
                torch.randn(self.cache.tensor.shape, generator=torch.Generator().manual_seed(fill_seed))
            )
        transport = TorchDistTransport(worker_id, LINK_KEY)
        self.sender = KVSender(transport, timeout=KV_TIMEOUT)
        self.receiver = KVReceiver(transport, timeout=KV_TIMEOUT)
        for endpoint in (self.sender, self.receiver):
            endpoint.register_kv_cache(self.cache)

    def address(self) -> str:
        return self.sender.address()

    def expect(self, block_ids, sources, request_id: str = "req") -> int:
        return self.receiver.expect(request_id, block_ids, sources)

    def send(self, block_ids, target: KVTarget, request_id: str = "req") -> bool:
        """Stream all layers of `block_ids` as one chunk, then DONE; wait for the outcome."""

        class Chunk:  # what the model runner hands the hook: a request's blocks and the computed span
            class request:  # noqa: N801
                pass

            start, num_new_tokens = 0, len(block_ids) * 16
            samples, generates = True, False  # a whole prompt, its first token sampled in this step

        Chunk.request.request_id, Chunk.request.block_ids = request_id, block_ids
        self.sender.add(request_id, [target])
        for layer in range(4):
            self.sender.save_kv_layer(layer, [Chunk])
        self.sender.forward_done([Chunk])
        self.sender.finish(request_id, first_token=7)
        return self._wait(self.sender)

    def mapped_peer_caches(self) -> list[str]:
        """Senders whose shared cache this receiver has mapped (it got KV by reference from them)."""
        return list(self.receiver._peer_caches)

    def wait_received(self):
        return self._wait(self.receiver)

    def _wait(self, endpoint):
        deadline = time.monotonic() + 2 * KV_TIMEOUT
        while time.monotonic() < deadline:
            results = endpoint.poll()
            if results:
                return results[0]
            time.sleep(0.005)
        return None

    def blocks(self, block_ids) -> torch.Tensor:
        return self.cache.export_blocks(block_ids)


# Between actors on one host a shared sender cache goes by reference once the pair is up (the
# first transfer connects it, so it is packed); otherwise every transfer is packed.
@pytest.mark.parametrize("shared", [False, True], ids=["packed", "by-reference"])
def test_random_blocks_arrive_byte_exact_in_scattered_blocks(ray_session, shared):
    src, dst = (
        CacheActor.remote(f"bx-src-{shared}", 64, fill_seed=11, shared=shared),
        CacheActor.remote(f"bx-dst-{shared}", 64, fill_seed=None),
    )
    src_address, dst_address = ray.get([src.address.remote(), dst.address.remote()])
    for request_id, src_blocks, dst_blocks in [
        ("first", [3, 40, 7, 8, 21, 60], [50, 2, 33, 9, 17, 44]),
        ("second", [4, 5, 6, 30], [10, 11, 58, 1]),
    ]:
        transfer_id = ray.get(dst.expect.remote(dst_blocks, {f"bx-src-{shared}": src_address}, request_id))
        target = KVTarget(f"bx-dst-{shared}", dst_address, transfer_id, dst_blocks, (0, 4), (0, 8))
        received = dst.wait_received.remote()
        sent = ray.get(src.send.remote(src_blocks, target, request_id))
        got = ray.get(received)
        assert sent.ok and got.ok and got.first_token == 7
        assert torch.equal(ray.get(src.blocks.remote(src_blocks)), ray.get(dst.blocks.remote(dst_blocks))), request_id
    written = [50, 2, 33, 9, 17, 44, 10, 11, 58, 1]
    untouched = [b for b in range(64) if b not in written][:5]
    assert torch.count_nonzero(ray.get(dst.blocks.remote(untouched))) == 0, "no other block was written"
    assert ray.get(dst.mapped_peer_caches.remote()) == ([f"bx-src-{shared}"] if shared else [])
    ray.kill(src)
    ray.kill(dst)


def test_killed_receiver_fails_sender_within_timeout_then_next_receiver_works(ray_session):
    model, prompt_len = "random:smollm2-135m", 1500
    prefill = PrefillActor.remote("p-kill", model, max_num_batched_tokens=32, num_kv_blocks=256)
    doomed = DecodeActor.remote("d-kill-1", model, num_kv_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = random_prompts([prompt_len], vocab=49152)[0]
    handshake(prefill, doomed, "p-kill", "d-kill-1", "long", prompt, params)
    running = prefill.run_until_idle.remote(60)
    deadline = time.monotonic() + 30
    while ray.get(doomed.received_bytes.remote()) == 0:  # kill it mid-transfer, once KV flows
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ray.kill(doomed)
    started = time.monotonic()
    assert ray.get(running) == ["long"], "the sender reports the transfer failed"
    assert time.monotonic() - started < KV_TIMEOUT + 5
    free, total = ray.get(prefill.blocks.remote())
    assert free == total
    fresh = DecodeActor.remote("d-kill-2", model, num_kv_blocks=256)
    short = random_prompts([40], vocab=49152, seed=9)[0]
    handshake(prefill, fresh, "p-kill", "d-kill-2", "after", short, params)
    decoded = fresh.run_until_idle.remote(60)
    assert ray.get(prefill.run_until_idle.remote(60)) == ["long"], "no new failure"
    assert len(ray.get(decoded)["after"]) == 4
    ray.kill(prefill)
    ray.kill(fresh)
