"""A windowed transfer's bytes: a PREFILL and a DECODE worker over the in-process transport, on
Mistral's tiny random checkpoint (a 32-token window on every layer, 16-token blocks). The
decode side reserves only a prompt's last window (placeholders before it), the prefill sends
only those blocks, by reference and packed, with targets in force from the start or arriving
after the prompt is done; the bytes both endpoints count are exactly those blocks', and the
tokens are the colocated engine's."""

from __future__ import annotations

import pytest
from support import random_prompts
from support import run_transfers as run
from support import submit_transfer as submit

from disagg import LLM, EngineConfig, SamplingParams
from disagg.decode_worker.role import DecodeRole
from disagg.engine.block_manager import PLACEHOLDER, num_held, out_of_window_blocks
from disagg.kv_transfer.inproc import InProcessHub, InProcessTransport
from disagg.prefill_worker.role import PrefillRole

WINDOW, BLOCK = 32, 16
LENGTHS = [400, 100, 20]  # 12 windows, 3, less than one


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def case(family_dir):
    model = family_dir("mistral")
    prompts = random_prompts(LENGTHS, 512, seed=9)
    llm = LLM(model=model, dtype="float32", num_kv_blocks=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
    return model, prompts, [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(params=[True, False], ids=["by-reference", "packed"])
def pair(case, request):
    hub = InProcessHub()
    # Chunks of 64 tokens (fair prefill off): each ends on a block boundary, so no block is sent
    # twice (a chunk that ends inside a block sends it again with the next chunk).
    config = dict(model=case[0], dtype="float32", max_num_batched_tokens=64, num_kv_blocks=64)
    config_p = dict(config, long_prefill_token_threshold=0, kv_shared_memory=request.param)
    prefill = PrefillRole(EngineConfig(**config_p), InProcessTransport("prefill-0", hub), kv_timeout=5.0)
    decode = DecodeRole(EngineConfig(**config), InProcessTransport("decode-0", hub), kv_timeout=5.0)
    yield prefill, decode
    prefill.close()
    decode.close()


def window_blocks(num_tokens: int) -> int:
    """The blocks of a prompt the decode side reads: its last window's and the one being filled."""
    return -(-num_tokens // BLOCK) - out_of_window_blocks(num_tokens, BLOCK, WINDOW)


def block_bytes(worker) -> int:
    """K and V of one block over every layer and KV head."""
    cache = worker.engine.kv_cache
    return cache.slice_bytes(cache.num_layers, (0, cache.num_kv_heads), 1)


def test_only_the_last_window_is_reserved_and_moved(pair, case):
    prefill, decode = pair
    _, prompts, expected = case
    got, held = [], []
    for i, prompt in enumerate(prompts):  # one at a time: each prompt's chunks start on a block
        submit(prefill, decode, f"r{i}", prompt, greedy())
        held.append(num_held(decode.engine.scheduler.requests[f"r{i}"].block_ids))
        assert decode.engine.block_manager.num_used_blocks == held[-1]
        got.append(run(prefill, decode)[f"r{i}"])
    assert got == expected
    assert held == [window_blocks(n) for n in LENGTHS] == [2, 3, 2]
    moved = sum(window_blocks(n) for n in LENGTHS) * block_bytes(decode)
    assert decode.receiver.num_bytes_total == prefill.sender.num_bytes_total == moved
    # Against the whole prompts' blocks (what a model without a window moves): 7 of 34 blocks.
    assert moved / (sum(-(-n // BLOCK) for n in LENGTHS) * block_bytes(decode)) == 7 / 34
    for engine in (prefill.engine, decode.engine):
        assert engine.num_free_blocks == engine.num_total_blocks


def test_targets_that_come_after_the_prompt_is_done_get_its_last_window(pair, case):
    """The prefill released the blocks behind the window as it went; the late targets (the
    catch-up) take the window's blocks from what it still holds."""
    prefill, decode = pair
    _, prompts, expected = case
    prefill.prefill("late", prompts[0], greedy())
    request = prefill.engine.scheduler.requests["late"]
    while not request.num_output_tokens:
        prefill.step()
    assert request.num_released_blocks == out_of_window_blocks(LENGTHS[0], BLOCK, WINDOW) == 23
    assert prefill.engine.block_manager.num_used_blocks == 2
    reservation = decode.reserve("late", prompts[0], greedy(), prefill.kv_layout())
    assert reservation.block_ids[:23] == [PLACEHOLDER] * 23
    prefill.set_kv_targets("late", reservation)
    assert run(prefill, decode)["late"] == expected[0]
    assert decode.receiver.num_bytes_total == 2 * block_bytes(decode)
