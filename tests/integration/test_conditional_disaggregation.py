"""Conditional disaggregation end to end: a decode instance prefills a short prompt itself when
the router predicts that faster than the prefill pool (no KV transfer, one hop less), and the
answer is the one disaggregated serving gives. Real Ray, redis-server and gRPC on 127.0.0.1."""

from __future__ import annotations

import pytest

from disagg.client import DisaggClient, generate_request
from disagg.config import ServingConfig
from disagg.server import Server

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?", "Who wrote Hamlet?"]
LIMIT = 128  # tokens: the chat prompts above are about 50 with the template


@pytest.fixture(scope="module")
def server(ray_session):
    config = ServingConfig.from_dict(
        {
            "engine": {"num_kv_blocks": 200, "max_num_batched_tokens": 256},
            "prefill": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "decode": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "port": 0,
            "metrics_port": 0,
            "heartbeat_interval_s": 0.2,
            "local_prefill_max_tokens": LIMIT,
            "calibration_s": 0,  # the models learn from the client's requests here, starting from a guess
        }
    )
    with Server(config) as srv:
        yield srv


def ask(client, question: str, max_tokens: int = 8):
    request = generate_request(chat=[{"role": "user", "content": question}], temperature=0.0, max_tokens=max_tokens)
    tokens, _, final = client.generate(request, timeout=60)
    return tokens, final.timings


def test_short_prompts_go_local_once_the_model_predicts_it_faster_with_the_same_answers(server):
    with DisaggClient(server.address) as client:
        first = {q: ask(client, q) for q in QUESTIONS}  # the models calibrate on these
        assert all(t.prefill_instance != t.decode_instance for _, t in first.values())  # a guess places nothing local
        later = [(q, *ask(client, q)) for _ in range(4) for q in QUESTIONS]
    local = [(q, tokens) for q, tokens, t in later if t.prefill_instance == t.decode_instance]
    assert local, "no request was prefilled on the decode instance"
    for question, tokens in local:
        assert tokens == first[question][0]  # greedy: the same answer as disaggregated


def test_a_prompt_whose_uncached_tokens_are_over_the_limit_is_always_disaggregated(server):
    # Each prompt differs from its first words on: the decode instance holds the KV of the ones
    # before it (moved there for decoding), and a cached prefix would rightly count as no work.
    questions = [
        f"Summarize text number {i}: " + "the quick brown fox jumps over the lazy dog. " * 20 for i in range(3)
    ]
    with DisaggClient(server.address) as client:
        timings = [ask(client, question, max_tokens=2)[1] for question in questions]
    assert all(t.prefill_instance != t.decode_instance for t in timings)
