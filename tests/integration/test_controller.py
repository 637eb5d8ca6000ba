"""The deployment's controller (disagg.controller): real Ray, Redis, gRPC on 127.0.0.1, the
default model. Killed, Ray starts it again, and it adopts the workers that outlived it (same
actors, no relaunch) instead of launching others; the deployment serves throughout. Gone for good,
the frontends report NOT_SERVING (gRPC and HTTP) after a grace, and stopping the server still leaves no actor of the deployment."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import chat_request

from disagg.bench.launcher import free_port
from disagg.client import DisaggClient
from disagg.cluster.launcher import NAMESPACE
from disagg.config import ServingConfig
from disagg.controller.controller import find_controller
from disagg.server import Server

COMEBACK_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server(ray_session):
    config = ServingConfig.from_dict(
        {
            "engine": {"num_kv_blocks": 200, "max_num_batched_tokens": 256},
            "prefill": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "decode": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "port": 0,
            "http_port": 0,
            "heartbeat_interval_s": 0.3,
            "heartbeat_ttl_s": 1.0,
            "calibration_s": 0,
            "replan": False,
        }
    )
    with Server(config, detached_controller=True) as srv:
        yield srv


def controller_status(controller) -> dict:
    """Once the controller (restarted or not) has adopted or launched every instance."""
    deadline = time.monotonic() + COMEBACK_TIMEOUT_S
    while True:
        try:
            ray.get(controller.ready.remote(COMEBACK_TIMEOUT_S), timeout=COMEBACK_TIMEOUT_S)
            return ray.get(controller.status.remote(), timeout=10)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.ActorDiedError):
            assert time.monotonic() < deadline, "the controller did not come back"
            time.sleep(0.5)


def test_a_killed_controller_comes_back_and_adopts_the_workers(server):
    controller = find_controller(server.deployment_id)
    before = controller_status(controller)
    workers = {i.instance_id: i.actor._actor_id for i in server.launcher.instances}
    assert not before["restarted"] and len(workers) == 2

    ray.kill(controller, no_restart=False)  # as a crash: Ray starts it again
    after = controller_status(controller)
    assert after["restarted"] and after["pid"] != before["pid"]
    assert {i.instance_id: i.actor._actor_id for i in server.launcher.instances} == workers, "adopted, not relaunched"
    with DisaggClient(server.address) as client:
        _, text, _ = client.generate(chat_request("What is the capital of France?", max_tokens=8))
    assert text


def test_workers_are_detached_named_actors_of_the_deployment(server):
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}
    assert f"controller-{server.deployment_id}" in names
    assert {i.actor_name.removeprefix(f"{NAMESPACE}-") for i in server.launcher.instances} <= {
        n.removeprefix(f"{NAMESPACE}-") for n in names
    }


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def http_health(address: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as refused:
        return refused.code


GRACE_S = 3.0


def test_a_controller_gone_for_good_turns_health_not_serving_and_stop_still_leaves_nothing(ray_session):
    """gRPC's health and HTTP /health both: SERVING through the grace (Ray may be restarting it),
    NOT_SERVING (503) after it."""
    config = ServingConfig.from_dict(
        {
            "engine": {"num_kv_blocks": 64},
            "prefill": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "decode": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "port": 0,
            "http_port": free_port(),
            "health_without_key": True,
            "heartbeat_interval_s": 0.3,
            "heartbeat_ttl_s": 1.0,
            "controller_grace_s": GRACE_S,
            "calibration_s": 0,
            "warm_up": False,
            "replan": False,
        }
    )
    with Server(config, detached_controller=True) as srv:
        deployment = srv.deployment_id
        assert health(srv.address) == health_pb2.HealthCheckResponse.SERVING
        assert http_health(srv.http_address) == 200
        ray.kill(find_controller(deployment), no_restart=True)
        killed_at = time.monotonic()
        while health(srv.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < killed_at + 20, "health still SERVING with no controller"
            time.sleep(0.2)
        assert time.monotonic() - killed_at >= GRACE_S, "NOT_SERVING within the grace"
        assert http_health(srv.http_address) == 503
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
    assert not [n for n in names if deployment in n], names
