"""The KV transfer protocol between a PREFILL and a DECODE worker, over the in-process transport."""

from __future__ import annotations

import time

import pytest
import torch

from disagg import LLM, SamplingParams
from disagg.config import EngineConfig
from disagg.decode_worker.worker import DecodeWorker
from disagg.kv_transfer.inproc import InProcessHub, InProcessTransport
from disagg.kv_transfer.sender import KVTarget
from disagg.prefill_worker.worker import PrefillWorker

MODEL = "random:tiny"
PROMPT_LENGTHS = [1, 7, 16, 33, 100, 250]  # 250 is chunked by the prefill budget below


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def colocated_tokens() -> list[list[int]]:
    llm = LLM(MODEL, num_kv_blocks=256)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts()], greedy(), use_tqdm=False)]


@pytest.fixture
def pair():
    hub = InProcessHub()
    prefill = PrefillWorker(EngineConfig(model=MODEL, max_num_batched_tokens=64, num_kv_blocks=128), InProcessTransport("prefill-0", hub), kv_timeout=5.0)
    decode = DecodeWorker(EngineConfig(model=MODEL, num_kv_blocks=128), InProcessTransport("decode-0", hub), kv_timeout=5.0)
    yield hub, prefill, decode
    prefill.close()
    decode.close()


def submit(prefill: PrefillWorker, decode: DecodeWorker, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    """The router's handshake: reserve on decode, then hand the prefill its target."""
    reservation = decode.reserve(request_id, prompt, params, {"prefill-0": prefill.address()})
    assert reservation is not None
    num_layers, num_heads = prefill.engine.model_config.num_hidden_layers, prefill.engine.model_config.num_key_value_heads
    target = KVTarget("decode-0", decode.address(), reservation.transfer_id, reservation.block_ids, (0, num_layers), (0, num_heads))
    prefill.add_request(request_id, prompt, params, [target])


def run(prefill: PrefillWorker, decode: DecodeWorker, timeout: float = 60.0) -> dict[str, list[int]]:
    finished: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout
    while not (prefill.is_idle() and decode.is_idle()):
        assert time.monotonic() < deadline, "transfer did not complete"
        prefill.step()
        for out in decode.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if prefill.engine.scheduler.held_for_export and not decode.engine.scheduler.running:
            time.sleep(0.001)  # waiting on the channel threads only
    return finished


def test_disaggregated_tokens_equal_colocated(pair, colocated_tokens):
    _, prefill, decode = pair
    for i, p in enumerate(prompts()):
        submit(prefill, decode, f"r{i}", p, greedy())
    finished = run(prefill, decode)
    assert [finished[f"r{i}"] for i in range(len(PROMPT_LENGTHS))] == colocated_tokens
    for engine in (prefill.engine, decode.engine):
        assert engine.num_free_blocks == engine.num_total_blocks


def test_prefix_cached_prompt_still_sends_every_block(pair, colocated_tokens):
    _, prefill, decode = pair
    long_prompt = prompts()[-1]
    submit(prefill, decode, "first", long_prompt, greedy())
    run(prefill, decode)
    submit(prefill, decode, "again", long_prompt, greedy())  # the prefill side hits its prefix cache
    finished = run(prefill, decode)
    assert finished["again"] == colocated_tokens[-1]
    assert prefill.engine.num_free_blocks == prefill.engine.num_total_blocks


def test_dead_receiver_fails_the_transfer_and_frees_prefill_blocks(pair):
    hub, prefill, decode = pair
    submit(prefill, decode, "doomed", prompts()[-1], greedy())
    hub.kill("decode-0")
    started = time.monotonic()
    while not prefill.is_idle():
        prefill.step()
        assert time.monotonic() - started < 6.0, "sender did not give up within its timeout"
        time.sleep(0.005)
    assert prefill.engine.num_free_blocks == prefill.engine.num_total_blocks


def test_dead_sender_fails_the_transfer_and_frees_decode_blocks(pair):
    hub, prefill, decode = pair
    submit(prefill, decode, "orphan", prompts()[2], greedy())
    hub.kill("prefill-0")
    started = time.monotonic()
    while not decode.is_idle():
        decode.step()
        assert time.monotonic() - started < 6.0
        time.sleep(0.005)
    assert [f.request_id for f in decode.failed] == ["orphan"] or decode.engine.num_free_blocks == decode.engine.num_total_blocks
    assert decode.engine.num_free_blocks == decode.engine.num_total_blocks


def test_decode_abort_drops_late_kv_without_writing(pair):
    _, prefill, decode = pair
    submit(prefill, decode, "cancelled", prompts()[3], greedy())
    decode.abort("cancelled")
    assert decode.engine.num_free_blocks == decode.engine.num_total_blocks
    submit(prefill, decode, "next", prompts()[1], greedy())
    finished = run(prefill, decode, timeout=20)
    assert "next" in finished and "cancelled" not in finished
    assert prefill.engine.num_free_blocks == prefill.engine.num_total_blocks
    assert decode.engine.num_free_blocks == decode.engine.num_total_blocks
