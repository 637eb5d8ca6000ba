"""Peer block fetch between real roles over torch.distributed (gloo, 127.0.0.1): a prefill
instance that lacks a prompt's prefix takes its blocks from the instance that holds them (here the
decode instance that decoded the conversation's first turn), by reference from shared memory or
packed. The fetched blocks are bit for bit those the holder computed and those a fresh engine
computes for the same tokens; the next turn's greedy tokens are those served without the fetch;
and a holder that no longer has the blocks (a stale index entry) costs a recompute, not an error."""

from __future__ import annotations

import time

import pytest
from support import random_prompts
from support import run_transfers as run
from support import submit_transfer as submit

from disagg import LLM, EngineConfig, SamplingParams
from disagg.decode_worker.role import DecodeRole
from disagg.kv_transfer.torch_dist import TorchDistTransport
from disagg.prefill_worker.role import PrefillRole
from disagg.request import Request

KEY = b"k" * 32
BS = 16
# No host tier: a block the pool reuses is gone (a holder lending from its tiers: test_peer_fetch_rule.py).
ENGINE = dict(model="random:tiny", dtype="float32", num_kv_blocks=64, max_model_len=512, kv_host_tier_bytes=0)
FIRST, ANSWER, MORE = 70, 12, 30  # turn 1's prompt, its answer's tokens, turn 2's new message


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def transport(name: str) -> TorchDistTransport:
    return TorchDistTransport(name, KEY, "127.0.0.1")


@pytest.fixture(params=[True, False], ids=["by-reference", "packed"])
def cluster(request):
    """A prefill and a decode instance that served turn 1, and a second prefill instance that
    never saw it: each with its KV endpoints and those that lend and fetch blocks."""
    config = EngineConfig(**ENGINE, kv_shared_memory=request.param)
    timeout = dict(kv_timeout=5.0)
    p0 = PrefillRole(config, transport("p0"), export_transport=transport("p0-export"), **timeout)
    d0 = DecodeRole(config, transport("d0"), export_transport=transport("d0-export"), **timeout)
    p1 = PrefillRole(config, transport("p1"), import_transport=transport("p1-import"), **timeout)
    roles = (p0, d0, p1)
    yield roles
    for role in roles:
        role.close()


def settle_until(future, roles, timeout: float = 20.0):
    """Step the peers' halves (as each instance's loop does) until `future` has its answer."""
    deadline = time.monotonic() + timeout
    while not future.done():
        assert time.monotonic() < deadline, "the fetch did not end"
        for role in roles:
            role.peers.settle()
        time.sleep(0.002)
    return future.result()


def serve_turn_one(p0, d0) -> list[int]:
    """Turn 1 through p0 and d0; returns turn 2's prompt (turn 1, its answer, a new message)."""
    (first, more) = random_prompts([FIRST, MORE], 256, seed=3)
    submit(p0, d0, "turn-1", first, greedy(ANSWER))
    answer = run(p0, d0)["turn-1"]
    return first + answer + more


def fetch(holder, fetcher, prompt: list[int], num_blocks: int):
    slot = fetcher.reserve_peer_import("turn-2~fetch", prompt, num_blocks, holder.peer_export_layout())
    assert slot is not None
    done = holder.export_prefix("turn-2~fetch", prompt, num_blocks, slot)
    return settle_until(done, (holder, fetcher))


def blocks(role, prompt: list[int], num_blocks: int):
    """The KV (every layer) of the prompt's first blocks, as the role's prefix cache holds them."""
    block_ids = role.engine.block_manager.cached_run(prompt, num_blocks)
    assert len(block_ids) == num_blocks
    return role.engine.kv_cache.export_blocks(block_ids)


def serve_turn_two(prefill, d0, prompt: list[int]):
    result = prefill.prefill("turn-2", prompt, greedy(8))
    reservation = d0.reserve("turn-2", prompt, greedy(8), prefill.kv_layout())
    prefill.set_kv_targets("turn-2", reservation)
    tokens = run(prefill, d0)["turn-2"]
    return tokens, result.result(timeout=5).num_cached_tokens


def test_a_fetched_block_is_the_one_recomputed_and_the_tokens_are_unchanged(cluster):
    p0, d0, p1 = cluster
    prompt = serve_turn_one(p0, d0)
    num_blocks = (FIRST + ANSWER - 1) // BS  # the history's full blocks the decode instance computed
    assert fetch(d0, p1, prompt, num_blocks) is True
    # One host: a cache in shared memory goes by reference (p1 copies out of d0's cache), else packed.
    assert d0.peers.exports.sender.transport.path_to("p1-import").by_reference
    assert (d0.engine.kv_cache.shared_handle is not None) is d0.engine.config.kv_shared_memory
    fetched = blocks(p1, prompt, num_blocks)
    assert fetched.equal(blocks(d0, prompt, num_blocks))  # bit for bit the holder's
    assert p1.peers.imports.fetched_blocks == num_blocks and p1.peers.imports.fetched_bytes == fetched.nbytes
    # An engine of its own computes turn 1's prompt as turn 1's prefill did (one chunk): those
    # blocks are bit for bit the fetched ones. The answer's were computed a token a step by the
    # decode instance, so a prefill of them in one chunk agrees to rounding only (other GEMM shapes).
    recompute = LLM(**ENGINE)
    recompute.generate([{"prompt_token_ids": prompt[:FIRST]}], greedy(ANSWER), use_tqdm=False)
    own = recompute.engine.kv_cache.export_blocks(recompute.engine.block_manager.cached_run(prompt, num_blocks))
    assert fetched[:, :, :, : FIRST // BS].equal(own[:, :, :, : FIRST // BS])
    assert fetched.equal(own)  # its decode steps too: the same shapes, the same bits

    tokens, cached = serve_turn_two(p1, d0, prompt)
    assert cached == num_blocks * BS  # the prefill took the fetched blocks
    (alone,) = LLM(**ENGINE, enable_prefix_caching=False).generate(
        [{"prompt_token_ids": prompt}], greedy(8), use_tqdm=False
    )
    assert tokens == alone.outputs[0].token_ids
    for role in cluster:  # nothing pinned, nothing leaked
        assert role.is_idle() and role.engine.num_free_blocks == role.engine.num_total_blocks


def test_a_holder_that_lost_the_blocks_costs_a_recompute_not_an_error(cluster):
    p0, d0, p1 = cluster
    prompt = serve_turn_one(p0, d0)
    num_blocks = (FIRST + ANSWER - 1) // BS
    # The index still lists p0 for turn 2's prefix, but p0 has reused those blocks since.
    pool = p0.engine.block_manager
    others = Request("others", [1] * (pool.num_free_blocks * BS), SamplingParams())
    assert pool.allocate_slots(others, others.num_tokens)  # every free block, the cached ones too
    pool.free(others)
    assert pool.cached_run(prompt, num_blocks) == [] and p0.engine.num_free_blocks == p0.engine.num_total_blocks
    assert fetch(p0, p1, prompt, num_blocks) is False  # nothing lent, nothing raised
    p1.abort("turn-2~fetch")  # what the router does with a fetch that failed: the slot goes back
    assert p1.engine.num_free_blocks == p1.engine.num_total_blocks and not p1.peers.active

    tokens, cached = serve_turn_two(p1, d0, prompt)
    assert cached == 0  # computed, from the first token
    (alone,) = LLM(**ENGINE, enable_prefix_caching=False).generate(
        [{"prompt_token_ids": prompt}], greedy(8), use_tqdm=False
    )
    assert tokens == alone.outputs[0].token_ids
    assert p0.is_idle() and p0.engine.num_free_blocks == p0.engine.num_total_blocks


def test_an_export_given_up_keeps_its_blocks_until_its_timeout(cluster):
    """The router gave up on a fetch (its timeout): both sides drop it. The holder's blocks stay
    pinned for the transfer's timeout all the same: a reference to them may still be copied."""
    p0, d0, p1 = cluster
    prompt = serve_turn_one(p0, d0)
    num_blocks = (FIRST + ANSWER - 1) // BS
    d0.peers.exports.sender.timeout = 0.3
    slot = p1.reserve_peer_import("turn-2~fetch", prompt, num_blocks, d0.peer_export_layout())
    d0.export_prefix("turn-2~fetch", prompt, num_blocks, slot)
    d0.abort("turn-2~fetch")
    p1.abort("turn-2~fetch")
    assert d0.engine.block_manager.cached_run(prompt, num_blocks) and not d0.is_idle()
    assert d0.engine.num_free_blocks == d0.engine.num_total_blocks - num_blocks
    deadline = time.monotonic() + 5
    while not d0.is_idle():
        assert time.monotonic() < deadline
        if d0.has_work():
            d0.step()
        time.sleep(0.01)
    assert d0.engine.num_free_blocks == d0.engine.num_total_blocks
    assert p1.engine.num_free_blocks == p1.engine.num_total_blocks and p1.is_idle()
