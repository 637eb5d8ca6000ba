"""Live migration between two decode workers: a request moves mid-stream with its KV (pre-copy,
then a pause at a step boundary) and decodes on; its tokens before and after the move are
exactly those of the same request never moved, greedy and seeded; nothing is recomputed; a
move that fails resumes at the source; every block is free at the end."""

from __future__ import annotations

import time

import pytest
from support import random_prompts

from disagg import LLM, EngineConfig, SamplingParams
from disagg.decode_worker.role import DecodeRole
from disagg.kv_transfer.inproc import InProcessHub, InProcessTransport
from disagg.request import priority_value

MAX_TOKENS = 24
MOVE_AFTER = 6  # output tokens before the move starts
TIMEOUT_S = 180.0  # a loaded 2-core machine: SmolLM2 decodes ~48 tokens x 3 requests on two engines


def _worker(model_dir: str, hub: InProcessHub, name: str) -> DecodeRole:
    config = EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=256)
    return DecodeRole(
        config,
        InProcessTransport(f"{name}-kv", hub),
        kv_timeout=10.0,
        migration_transport=InProcessTransport(f"{name}-move", hub),
    )


def _unmoved(model_dir: str, prompts, params) -> list[list[int]]:
    llm = LLM(model=model_dir, dtype="float32", num_kv_blocks=128)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _run_with_move(model_dir: str, prompts, params, *, break_target: bool = False):
    """Every prompt decodes on A; the first moves to B after MOVE_AFTER tokens. Returns each
    request's tokens as the client would see them, the move, and both workers. Every request is
    critical (all of one priority: A's order is as without), and r0 must stay critical at B."""
    hub = InProcessHub()
    a, b = _worker(model_dir, hub, "a"), _worker(model_dir, hub, "b")
    streamed: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        a.submit(f"r{i}", p, params, priority_value("critical"))
    move, checked, deadline = None, False, time.monotonic() + TIMEOUT_S
    started_at_b: set[str] = set()
    while time.monotonic() < deadline and not (a.is_idle() and b.is_idle()):
        for out in a.step():
            streamed[out.request_id].extend(out.new_token_ids)
        for out in b.step():
            new = list(out.new_token_ids)
            if out.request_id not in started_at_b:  # its first output: the source's last token, already sent
                started_at_b.add(out.request_id)
                new = new[1:]
                assert b.engine.scheduler.requests[out.request_id].priority == priority_value("critical")
            streamed[out.request_id].extend(new)
        if move is None and len(streamed["r0"]) >= MOVE_AFTER:
            request = a.engine.scheduler.requests["r0"]
            known = request.token_ids[: request.num_computed_tokens]
            reservation = b.reserve_migration(  # as the router asks, with the priority it placed the request by
                "r0", known, params, len(prompts[0]), a.migration_layout(), len(known) + 32, None, request.priority
            )
            assert reservation is not None
            a.migrate_out("r0", reservation)
            move = a.requests["r0"].moving
            if break_target:
                b.abort("r0")  # the target gives up: the move must fail and r0 go on at A
        if move is not None and not checked and move.paused.done() and move.paused.exception() is None:
            tokens = move.paused.result()
            outputs = tokens[len(prompts[0]) :]
            assert streamed["r0"][: len(outputs)] == outputs, "paused after tokens the client has not seen"
            checked = True
        time.sleep(0.001)
    assert a.is_idle() and b.is_idle(), f"still decoding after {TIMEOUT_S:.0f} s: {streamed}"
    return [streamed[f"r{i}"] for i in range(len(prompts))], move, a, b


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([40, 9, 130], 512, seed=3)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_a_request_moved_mid_stream_decodes_exactly_as_unmoved(tiny_gqa_dir, prompts, params):
    expected = _unmoved(tiny_gqa_dir, prompts, params)
    got, move, a, b = _run_with_move(tiny_gqa_dir, prompts, params)
    assert move is not None and move.done.done() and move.done.result() is True, "the move did not complete"
    assert got == expected
    # Nothing recomputed: every step the target ran was decodes only, no prompt chunk.
    assert b.engine.step_stats and all(not s.work.chunks for s in b.engine.step_stats), "the target recomputed KV"
    for worker in (a, b):
        assert worker.engine.num_free_blocks == worker.engine.num_total_blocks
    a.close()
    b.close()


def test_a_windowed_request_moves_with_only_its_window(family_dir):
    """Mistral's tiny checkpoint (a 32-token window on every layer, 16-token blocks): the target
    reserves only the window's blocks of a 400-token request, and the source sends only those
    it still holds (it keeps decoding, and releasing, while the KV goes out); the target
    decodes on exactly as unmoved."""
    model = family_dir("mistral")
    prompts = random_prompts([400, 9], 512, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = _unmoved(model, prompts, params)
    got, move, a, b = _run_with_move(model, prompts, params)
    assert move is not None and move.done.result() is True and got == expected
    assert all(not s.work.chunks for s in b.engine.step_stats), "the target recomputed KV"
    cache = a.engine.kv_cache
    block_bytes = cache.slice_bytes(cache.num_layers, (0, cache.num_kv_heads), 1)
    moved = a.migrations_out.sender.num_bytes_total
    # The window's 2 or 3 blocks, and again those the pre-copy steps wrote into (at most 2): not
    # the whole request's 26.
    assert 2 * block_bytes <= moved <= 5 * block_bytes
    for worker in (a, b):
        assert worker.engine.num_free_blocks == worker.engine.num_total_blocks
    a.close()
    b.close()


@pytest.mark.slow
def test_a_structured_request_moves_with_its_grammar_state():
    """The grammar's state goes with the request (rebuilt at the target from the tokens it
    generated): the moved request's output is the unmoved one's, and still follows the schema,
    with jump-forward's multi-token steps on both sides of the move."""
    import json

    import jsonschema

    from disagg.config import DEFAULT_MODEL
    from disagg.request import StructuredOutput

    keys = ["the_name_of_the_city", "the_population_of_the_city_in_millions"]
    schema = {"type": "object", "properties": {keys[0]: {"type": "string"}, keys[1]: {"type": "integer"}}}
    schema.update(required=keys, additionalProperties=False)
    params = SamplingParams(
        temperature=0.8, seed=5, max_tokens=48, structured=StructuredOutput("json_schema", json.dumps(schema))
    )
    prompts = random_prompts([40, 9], 49152, seed=3)
    expected = _unmoved(DEFAULT_MODEL, prompts, params)
    got, move, a, b = _run_with_move(DEFAULT_MODEL, prompts, params)
    assert move is not None and move.done.result() is True, "the move did not complete"
    assert got == expected
    moved_at = len(prompts[0]) + MOVE_AFTER - 1
    forced_chunks = [c for s in b.engine.step_stats for c in s.work.chunks]
    assert forced_chunks, "the target never appended forced tokens: jump-forward untested across the move"
    assert all(c.start >= moved_at for c in forced_chunks), "the target recomputed KV"
    assert len(got[0]) < params.max_tokens, "the moved request did not reach its grammar's end"
    jsonschema.validate(json.loads(a.engine.tokenizer.decode(got[0])), schema)
    for worker in (a, b):
        assert worker.engine.num_free_blocks == worker.engine.num_total_blocks
    a.close()
    b.close()


def test_a_move_the_target_drops_resumes_at_the_source(tiny_gqa_dir, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = _unmoved(tiny_gqa_dir, prompts, params)
    got, move, a, b = _run_with_move(tiny_gqa_dir, prompts, params, break_target=True)
    assert move is not None and move.done.result() is False
    assert got == expected
    for worker in (a, b):
        assert worker.engine.num_free_blocks == worker.engine.num_total_blocks
    a.close()
    b.close()


def test_only_a_decoding_request_can_move(tiny_gqa_dir):
    hub = InProcessHub()
    a, b = _worker(tiny_gqa_dir, hub, "a"), _worker(tiny_gqa_dir, hub, "b")
    reservation = b.reserve_migration("x", [5, 6, 7], SamplingParams(max_tokens=4), 3, a.migration_layout(), 16)
    with pytest.raises(ValueError, match="not decoding here"):
        a.migrate_out("nobody", reservation)
    b.abort("x")
    assert b.engine.num_free_blocks == b.engine.num_total_blocks
    a.close()
    b.close()
