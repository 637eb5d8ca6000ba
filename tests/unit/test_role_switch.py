"""A role is rebuilt around another role's engine (what a worker's switch_role does,
disagg.worker.actor): a decode engine serves as prefill and back, its weights never reloaded,
exactly as a fresh one of its new role would; an engine that holds requests refuses to switch
and keeps serving."""

from __future__ import annotations

import pytest
from support import run_transfers as run, submit_transfer as submit
from test_kv_protocol import MODEL, greedy, prompts

from disagg import LLM, Role
from disagg.config import EngineConfig
from disagg.decode_worker.role import DecodeRole
from disagg.kv_transfer.inproc import InProcessHub, InProcessTransport
from disagg.prefill_worker.role import PrefillRole


@pytest.fixture(scope="module")
def colocated_tokens() -> list[list[int]]:
    llm = LLM(MODEL, num_kv_blocks=256)
    params = greedy()
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts()], params)]


def _config() -> EngineConfig:
    return EngineConfig(model=MODEL, max_num_batched_tokens=64, num_kv_blocks=128)


def switch_worker(old, role: Role, transport, kv_timeout: float):
    """`old`'s engine in `role`, over `transport`; `old` closed once the new role exists."""
    new_role = PrefillRole if role is Role.PREFILL else DecodeRole
    new = new_role(_config(), transport, kv_timeout=kv_timeout, engine=old.engine)
    old.close()
    return new


def _weights(worker) -> list[int]:
    return [p.data_ptr() for p in worker.engine.model.parameters()]


def test_decode_to_prefill_and_back_keeps_the_weights_and_serves_exactly(colocated_tokens):
    hub = InProcessHub()
    a = DecodeRole(_config(), InProcessTransport("a-kv", hub), kv_timeout=5.0)
    weights = _weights(a)
    prefill = switch_worker(a, Role.PREFILL, InProcessTransport("a-kv-2", hub), kv_timeout=5.0)
    assert prefill.engine is a.engine and _weights(prefill) == weights
    assert prefill.engine.config.role is Role.PREFILL and prefill.engine.scheduler.role is Role.PREFILL
    decode = DecodeRole(_config(), InProcessTransport("b-kv", hub), kv_timeout=5.0)
    for i, p in enumerate(prompts()):
        submit(prefill, decode, f"r{i}", p, greedy())
    finished = run(prefill, decode)
    assert [finished[f"r{i}"] for i in range(len(prompts()))] == colocated_tokens
    # ...and back to decoding, now taking KV from the other worker switched to prefill.
    other = switch_worker(decode, Role.PREFILL, InProcessTransport("b-kv-2", hub), kv_timeout=5.0)
    back = switch_worker(prefill, Role.DECODE, InProcessTransport("a-kv-3", hub), kv_timeout=5.0)
    assert _weights(back) == weights and back.engine.config.role is Role.DECODE
    for i, p in enumerate(prompts()):
        submit(other, back, f"s{i}", p, greedy())
    finished = run(other, back)
    assert [finished[f"s{i}"] for i in range(len(prompts()))] == colocated_tokens
    for worker in (other, back):
        assert worker.engine.num_free_blocks == worker.engine.num_total_blocks
        worker.close()


def test_a_worker_with_requests_refuses_to_switch_and_serves_on(colocated_tokens):
    hub = InProcessHub()
    worker = DecodeRole(_config(), InProcessTransport("a-kv", hub), kv_timeout=5.0)
    worker.submit("r0", prompts()[0], greedy())
    with pytest.raises(ValueError, match="drain"):
        switch_worker(worker, Role.PREFILL, InProcessTransport("a-kv-2", hub), kv_timeout=5.0)
    assert worker.engine.config.role is Role.DECODE
    tokens = []
    while not worker.is_idle():
        tokens += [t for out in worker.step() for t in out.new_token_ids]
    assert tokens == colocated_tokens[0]
    worker.close()
