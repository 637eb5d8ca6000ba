"""The new model families through the disaggregated service: prefill on one worker, decode on
another (Gemma 3's prefill at TP=2, so its KV is resharded on the way), KV streamed chunk by
chunk under a 32-token budget, prompts several sliding windows long. Greedy output equals the
offline engine's on the same checkpoint, and every block is free afterwards."""

from __future__ import annotations

import time

import pytest
import ray
from support import random_prompts

from disagg import LLM, SamplingParams
from disagg.client import DisaggClient, generate_request
from disagg.cluster.launcher import NAMESPACE
from disagg.config import ServingConfig
from disagg.server import Server

PROMPTS = random_prompts([5, 40, 150, 260], 512, seed=9)  # up to 8 windows of 32 tokens
MAX_TOKENS = 10
PREFILL_POOLS = {"mistral": {}, "qwen2": {}, "qwen3": {}, "gemma3": {"tensor_parallel_size": 2}}


def offline_tokens(model: str) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def served_tokens(server: Server) -> list[list[int]]:
    with DisaggClient(server.address) as client:
        streams = [
            client.stream(
                generate_request(prompt_token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                timeout=120,
            )
            for p in PROMPTS
        ]
        return [[t for message in call for t in message.token_ids] for call in streams]


def serving_config(model: str, prefill: dict) -> ServingConfig:
    small = {"num_instances": 1, "num_cpus_per_worker": 0.25}
    return ServingConfig.from_dict(
        {
            "mode": "disaggregated",
            "port": 0,
            "http_port": 0,
            "engine": {"model": model, "dtype": "float32", "num_kv_blocks": 128, "max_num_batched_tokens": 32},
            "prefill": {**small, **prefill},
            "decode": small,
            "replan": False,
            "calibration_s": 0,
        }
    )


def assert_all_blocks_free(server: Server) -> None:
    deadline = time.monotonic() + 5
    for inst in server.launcher.instances:
        actor = ray.get_actor(inst.actor_name, namespace=NAMESPACE)
        while (load := ray.get(actor.status.remote())["load"]).num_free_blocks != load.num_total_blocks:
            assert time.monotonic() < deadline, f"{inst.instance_id} still holds blocks"
            time.sleep(0.05)


@pytest.mark.parametrize("kind", sorted(PREFILL_POOLS))
def test_disaggregated_family_equals_the_engine_alone(ray_session, family_dir, kind):
    model = family_dir(kind)
    expected = offline_tokens(model)
    with Server(serving_config(model, PREFILL_POOLS[kind])) as server:
        assert served_tokens(server) == expected
        assert_all_blocks_free(server)
