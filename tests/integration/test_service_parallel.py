"""Instances of several workers: a prefill pool at TP=2 streaming KV to a decode pool at PP=2,
and a colocated pool at TP=2 x PP=2, through the whole service (gRPC, router, Ray actors in
placement groups, per-instance gloo groups, per-rank KV transfer). Greedy output equals one
unsharded offline engine's, and every rank's blocks are free afterwards."""

from __future__ import annotations

import dataclasses
import os
import time

import grpc
import pytest
import ray

from disagg import LLM, SamplingParams
from disagg.client import DisaggClient, generate_request
from disagg.cluster.launcher import NAMESPACE
from disagg.server import Server
from disagg.config import ServingConfig

PROMPTS = [[5, 9, 14, 3, 7], list(range(3, 60)), [11], [8, 2, 30, 41] * 9, list(range(100, 140))]
MAX_TOKENS = 10


def offline_tokens(model: str) -> list[list[int]]:
    llm = LLM(model=model, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    ]


def served_tokens(server: Server) -> list[list[int]]:
    with DisaggClient(server.address) as client:
        streams = [
            client.stream(
                generate_request(prompt_token_ids=p, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                timeout=120,
            )
            for p in PROMPTS
        ]
        results = []
        for call in streams:  # all in flight at once
            tokens = []
            for message in call:
                tokens.extend(message.token_ids)
            results.append(tokens)
    return results


def config(model: str, pools: dict, mode: str) -> ServingConfig:
    small = {"num_cpus_per_worker": 0.25}
    data = {
        "mode": mode,
        "port": 0,
        "http_port": 0,  # the module runs servers side by side: they cannot all have the default HTTP port
        "replan": False,  # scaling would add instances where Ray has room, beside the other servers
        "engine": {"model": model, "dtype": "float32", "num_kv_blocks": 64, "max_num_batched_tokens": 24},
    }
    data.update({role: {**small, **pool} for role, pool in pools.items()})
    return ServingConfig.from_dict(data)


def assert_all_blocks_free(server: Server) -> None:
    deadline = time.monotonic() + 5
    for inst in server.launcher.instances:
        actor = ray.get_actor(inst.actor_name, namespace=NAMESPACE)
        while (load := ray.get(actor.status.remote())["load"]).num_free_blocks != load.num_total_blocks:
            assert time.monotonic() < deadline, f"{inst.instance_id} still holds blocks"
            time.sleep(0.05)


def step_rings_of(server: Server) -> list[int]:
    """How many step-channel rings (disagg.worker.shm_ring) each instance's rank 0 holds."""
    counts = []
    for inst in server.launcher.instances:
        pid = ray.get(ray.get_actor(inst.actor_name, namespace=NAMESPACE).ready.remote())["pid"]
        links = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:  # closed meanwhile
                pass
        counts.append(len({link for link in links if link.startswith("/memfd:disagg-ring-")}))  # mmap dups its fd
    return counts


@pytest.fixture(scope="module")
def disaggregated(ray_session, tiny_untied_dir):
    pools = {"prefill": {"tensor_parallel_size": 2}, "decode": {"pipeline_parallel_size": 2}}
    with Server(config(tiny_untied_dir, pools, "disaggregated")) as server:
        yield server


def test_prefill_tp2_to_decode_pp2(disaggregated, tiny_untied_dir):
    assert served_tokens(disaggregated) == offline_tokens(tiny_untied_dir)
    with DisaggClient(disaggregated.address) as client:
        status = client.cluster_status()
    plans = {p.role: (i.tensor_parallel_size, i.pipeline_parallel_size) for p in status.pools for i in p.instances}
    assert plans == {"prefill": (2, 1), "decode": (1, 2)}
    assert_all_blocks_free(disaggregated)


def test_an_instance_that_lost_a_rank_is_relaunched_whole(disaggregated, tiny_untied_dir):
    """Runs last on this server: a decode rank dies. Its instance leaves service, the launcher
    relaunches all its ranks under the same id, and a request sent after the kill is served in
    full by the new instance (it waits for the relaunch instead of failing)."""
    expected = offline_tokens(tiny_untied_dir)[0]
    decode = next(inst for inst in disaggregated.launcher.instances if inst.role == "decode")
    ray.kill(decode.shard_actors[0], no_restart=True)
    with DisaggClient(disaggregated.address) as client:
        tokens = []
        request = generate_request(prompt_token_ids=PROMPTS[0], temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for message in client.stream(request, timeout=120):
            tokens.extend(message.token_ids)
        assert tokens == expected
    relaunched = next(inst for inst in disaggregated.launcher.instances if inst.role == "decode")
    assert relaunched.instance_id == decode.instance_id and relaunched.relaunches == 1
    assert_all_blocks_free(disaggregated)


def test_an_instance_not_to_be_relaunched_leaves_at_once(ray_session, tiny_untied_dir):
    """max_worker_restarts 0: a decode instance that lost a rank fails its requests at once (no
    hang) and deregisters for good; with no decode instance left, requests get UNAVAILABLE at
    once, not after recovery_timeout_s."""
    pools = {"prefill": {"tensor_parallel_size": 2}, "decode": {"pipeline_parallel_size": 2}}
    cfg = dataclasses.replace(config(tiny_untied_dir, pools, "disaggregated"), max_worker_restarts=0)
    with Server(cfg) as server, DisaggClient(server.address) as client:
        decode = next(inst for inst in server.launcher.instances if inst.role == "decode")
        ray.kill(decode.shard_actors[0], no_restart=True)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as first:
            client.generate(generate_request(prompt_token_ids=PROMPTS[0], max_tokens=MAX_TOKENS), timeout=60)
        assert time.monotonic() - started < 30
        assert first.value.code() == grpc.StatusCode.UNAVAILABLE
        deadline = time.monotonic() + 10
        while any(p.role == "decode" and p.instances for p in client.cluster_status().pools):
            assert time.monotonic() < deadline, "the broken decode instance is still listed"
            time.sleep(0.2)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failure:
            client.generate(generate_request(prompt_token_ids=PROMPTS[0], max_tokens=MAX_TOKENS), timeout=60)
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 10, "waited for an instance that left for good"


def test_colocated_tp2_pp2(ray_session, tiny_untied_dir):
    expected = offline_tokens(tiny_untied_dir)
    pools = {"colocated": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}}
    with Server(config(tiny_untied_dir, pools, "colocated")) as server:
        assert served_tokens(server) == expected
        assert_all_blocks_free(server)
        assert step_rings_of(server) == [4]  # the steps went over shared memory: one ring out, one back per rank
