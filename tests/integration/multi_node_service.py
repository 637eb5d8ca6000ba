"""Run by test_multi_node.py in a process of its own (this test needs a Ray of its own): the
service on a Ray cluster of two nodes on this machine, the prefill pool pinned to one and the
decode pool to the other by node labels. Prints what the test checks, as JSON.

    python multi_node_service.py MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from urllib.parse import urlsplit

import ray
from ray.cluster_utils import Cluster

from disagg import LLM, SamplingParams
from disagg.client import DisaggClient, generate_request
from disagg.cluster.launcher import NAMESPACE
from disagg.server import Server
from disagg.config import ServingConfig
from disagg.registry import Registry

PROMPT = list(range(3, 40))
MAX_TOKENS = 8


def main(model: str) -> dict:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"prefill": 1}})
    cluster.add_node(num_cpus=1, resources={"decode": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, logging_level="WARNING")
    try:
        return _serve_and_check(model)
    finally:
        ray.shutdown()
        cluster.shutdown()


def _serve_and_check(model: str) -> dict:
    pools = {role: {"num_cpus_per_worker": 0.25} for role in ("prefill", "decode")}
    data = {"port": 0, "warm_up": False, "engine": {"model": model, "dtype": "float32", "num_kv_blocks": 64}, **pools}
    result = {"node_ip": ray.util.get_node_ip_address()}
    try:
        Server(ServingConfig.from_dict({**data, "redis_url": "redis://127.0.0.1:6399/0"})).start()
        result["loopback_redis_error"] = None
    except ValueError as exc:
        result["loopback_redis_error"] = str(exc)
    with Server(ServingConfig.from_dict(data)) as server:
        redis = urlsplit(server.redis.url)
        result["redis"] = {"host": redis.hostname, "has_password": bool(redis.password)}
        ready = ray.get([inst.actor.ready.remote() for inst in server.launcher.instances])
        result["nodes"] = {r["role"]: r["node_id"] for r in ready}
        registry = Registry(server.redis.url)
        result["advertised"] = {
            v.info.role: [v.info.rpc_address] + [rank[1] for rank in v.info.kv_ranks] for v in registry.instances()
        }
        registry.close()
        with DisaggClient(server.address) as client:
            stream = client.stream(
                generate_request(prompt_token_ids=PROMPT, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                timeout=120,
            )
            result["served"] = [t for message in stream for t in message.token_ids]
    llm = LLM(model=model, dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    result["offline"] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
