"""The colocated mode of the same service: one pool of instances that run both phases."""

from __future__ import annotations

import time

import pytest
import ray

from disagg import LLM, SamplingParams
from disagg.client import DisaggClient, generate_request
from disagg.cluster.launcher import NAMESPACE
from disagg.server import Server
from disagg.config import ServingConfig

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about rain.",
    "Who wrote Hamlet?",
]


@pytest.fixture(scope="module")
def server(ray_session):
    config = ServingConfig.from_dict(
        {
            "mode": "colocated",
            "engine": {"num_kv_blocks": 400},
            "colocated": {"num_instances": 1, "num_cpus_per_worker": 1},
            "port": 0,
        }
    )
    with Server(config) as srv:
        yield srv


def test_colocated_greedy_equals_offline(server):
    llm = LLM(num_kv_blocks=400)
    prompts = [
        {"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])} for q in QUESTIONS
    ]
    expected = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    ]
    del llm
    with DisaggClient(server.address) as client:
        got = [
            client.generate(
                generate_request(chat=[{"role": "user", "content": q}], temperature=0.0, max_tokens=16), timeout=120
            )
            for q in QUESTIONS
        ]
        status = client.cluster_status()
    assert [tokens for tokens, _, _ in got] == expected
    assert all(final.timings.prefill_instance == "" and final.timings.decode_instance for _, _, final in got)
    assert status.mode == "colocated" and [p.role for p in status.pools] == ["colocated"]
    assert server.warmed_up == [("", server.launcher.instances[0].instance_id)]  # no prefill instance in this mode


def test_colocated_cancel_frees_blocks(server):
    actor = ray.get_actor(server.launcher.instances[0].actor_name, namespace=NAMESPACE)
    with DisaggClient(server.address) as client:
        call = client.stream(generate_request("Once upon a time", max_tokens=300, ignore_eos=True))
        next(call)
        call.cancel()
    deadline = time.monotonic() + 1.5
    while True:
        load = ray.get(actor.status.remote())["load"]
        if load.num_free_blocks == load.num_total_blocks:
            break
        assert time.monotonic() < deadline, "blocks still held after cancel"
        time.sleep(0.05)
