"""Two frontends over the same instances (ServingConfig.frontends): real Ray, Redis, gRPC on
127.0.0.1, the default model. Frontend 1 is a Ray actor.

- each frontend serves, with the same greedy output;
- frontend 0's placement sees what frontend 1 placed: the decode instance's load, as its worker
  reports it, counts frontend 1's running streams;
- frontend 1 killed (SIGKILL) mid-stream: its streams fail, the workers free their blocks (their
  links closed), Ray restarts it and it serves again, while frontend 0 served throughout.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
import ray
from support import chat_request

from disagg.client import DisaggClient
from disagg.config import ServingConfig
from disagg.server import Server

RESTART_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server(ray_session):
    config = ServingConfig.from_dict(
        {
            "engine": {"num_kv_blocks": 200, "max_num_batched_tokens": 256},
            "prefill": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "decode": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "port": 0,
            "http_port": 0,
            "frontends": 2,
            "heartbeat_interval_s": 0.3,
            "heartbeat_ttl_s": 1.0,
            "calibration_s": 0,
            "replan": False,
        }
    )
    with Server(config) as srv:
        yield srv


def replica_pid(server) -> int:
    """The replica's process, once Ray has it running (calls fail while it restarts)."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        try:
            return ray.get(server.replicas[0].pid.remote(), timeout=RESTART_TIMEOUT_S)
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, "the replica did not come back"
            time.sleep(0.5)


def held_blocks(client: DisaggClient) -> int:
    """KV blocks allocated on every instance, as their workers report."""
    return sum(i.num_total_blocks - i.num_free_blocks for pool in client.cluster_status().pools for i in pool.instances)


def test_both_frontends_serve_the_same_output(server):
    addresses = server.frontend_addresses()
    assert len(addresses) == 2 and addresses[0] != addresses[1]
    outputs = []
    for address in addresses:
        with DisaggClient(address) as client:
            outputs.append(client.generate(chat_request("What is the capital of France?", max_tokens=12))[0])
    assert outputs[0] == outputs[1] and outputs[0]


def test_frontend_zero_sees_what_frontend_one_placed(server):
    decode = server.directory.healthy("decode")[0]
    assert decode.outstanding_requests == 0
    with DisaggClient(server.frontend_addresses()[1]) as client:
        stream = client.stream(chat_request("Write a long story about a dragon.", max_tokens=400))
        next(iter(stream))
        deadline = time.monotonic() + 10
        while decode.num_requests < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        seen = decode.num_requests
        assert decode.outstanding_requests == 0  # not frontend 0's own count: the worker's report
        stream.cancel()
    assert seen >= 1


def test_a_killed_frontend_frees_its_blocks_and_comes_back(server):
    first, second = server.frontend_addresses()
    pid = replica_pid(server)
    errors: list[grpc.StatusCode] = []

    def stream_through_replica(i: int) -> None:
        with DisaggClient(second) as client:
            try:
                for _ in client.stream(chat_request(f"Tell me story number {i}.", max_tokens=400)):
                    pass
            except grpc.RpcError as exc:
                errors.append(exc.code())

    threads = [threading.Thread(target=stream_through_replica, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    with DisaggClient(first) as client:
        deadline = time.monotonic() + 30
        while held_blocks(client) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert held_blocks(client) > 0, "the replica's streams hold no blocks"
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert len(errors) == 3  # its own streams are lost with it ...
        assert client.generate(chat_request("Why is the sky blue?", max_tokens=8))[0]  # ... frontend 0's are not
        with DisaggClient(f"{second},{first}") as balanced:  # round-robin over those that answer
            assert all(balanced.generate(chat_request("Name a fruit.", max_tokens=4))[0] for _ in range(3))
        deadline = time.monotonic() + 30
        while held_blocks(client) > 0 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert held_blocks(client) == 0, "the killed frontend's blocks leaked"
    assert replica_pid(server) != pid  # restarted by Ray
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        try:
            with DisaggClient(server.frontend_addresses()[1]) as client:
                assert client.generate(chat_request("Name a colour.", max_tokens=4), timeout=30)[0]
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the restarted frontend does not serve"
            time.sleep(1)
