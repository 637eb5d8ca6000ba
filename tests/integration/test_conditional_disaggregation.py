"""Conditional disaggregation end to end: a decode instance prefills a short prompt itself when
the router predicts that faster than the prefill pool (no KV transfer, one hop less), and the
answer is the one disaggregated serving gives. Real Ray, redis-server and gRPC on 127.0.0.1."""

from __future__ import annotations

import time
import urllib.request

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
            # A block moves in no time here (one host, by reference): any prefix a peer holds is
            # worth fetching (test_a_next_turn_fetches...).
            "peer_fetch_latency_ms": 0.0,
            "peer_fetch_gb_s": 1000.0,
            "calibration_s": 0,  # the models learn from the client's requests here, starting from a guess
            "replan": False,  # Ray has room for more instances here: scaling would add one under these tests
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


def test_a_next_turn_fetches_the_history_its_decode_instance_holds(server):
    """Turn 2 of a conversation is turn 1's prompt, its answer and a new message (longer than a
    decode instance prefills itself, even holding the history: disaggregated). The prefill instance holds turn 1's prompt; the
    decode instance holds the answer's blocks too: the prefill instance fetches those from it
    instead of computing them, and its prefill starts after them."""
    first = list(range(1000, 1040))  # 40 tokens: 2 full blocks
    with DisaggClient(server.address) as client:
        turn_1 = generate_request(prompt_token_ids=first, temperature=0.0, max_tokens=30, ignore_eos=True)
        answer, _, done = client.generate(turn_1, timeout=60)
        time.sleep(0.6)  # a heartbeat or two: the router learns which blocks the decode instance holds
        history = first + answer  # the decode instance holds 4 full blocks of its 70 tokens
        held = (len(history) - 1) // 16 * 16
        second = history + list(range(2000, 2300))  # more new tokens than a decode step takes (256): disaggregated
        turn_2 = generate_request(prompt_token_ids=second, temperature=0.0, max_tokens=2, ignore_eos=True)
        tokens, _, final = client.generate(turn_2, timeout=60)
        assert final.timings.prefill_instance != final.timings.decode_instance and len(tokens) == 2
        assert final.usage.cached_prompt_tokens == held  # fetched, then hit
        deadline, fetched = time.monotonic() + 10, 0
        while time.monotonic() < deadline and not fetched:  # as `disagg status` shows it (a heartbeat later)
            status = client.cluster_status()
            prefills = [i for pool in status.pools if pool.role == "prefill" for i in pool.instances]
            fetched = sum(i.kv_tiers.get("peer.fetched_blocks", 0) for i in prefills)
            time.sleep(0.2)
    assert fetched >= (held - len(first)) // 16
    # What the cache saved that prompt's prefill, by its instance's model: the TTFT saved.
    metrics = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    (saved,) = [line for line in metrics.splitlines() if line.startswith("disagg:kv_prefill_saved_seconds_total")]
    assert float(saved.split()[-1]) > 0
