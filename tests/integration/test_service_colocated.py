"""The colocated mode of the same service: one pool of instances that run both phases. This server
also runs with TLS and an API key, which every client here must use."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from disagg import LLM, SamplingParams
from disagg.client import DisaggClient, generate_request
from disagg.cluster.launcher import NAMESPACE
from disagg.server import Server
from disagg.config import ServingConfig
from tests.support import self_signed_certificate

API_KEY = "colocated-test-key"

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about rain.",
    "Who wrote Hamlet?",
]


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return self_signed_certificate(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def server(ray_session, tls):
    cert, key = tls
    config = ServingConfig.from_dict(
        {
            "mode": "colocated",
            "engine": {"num_kv_blocks": 400},
            "colocated": {"num_instances": 1, "num_cpus_per_worker": 1},
            "port": 0,
            "api_key": API_KEY,
            "tls_cert_file": cert,
            "tls_key_file": key,
            "calibration_s": 0,  # placement's measured models are test_calibration.py's
            "metrics_port": 0,
        }
    )
    with Server(config) as srv:
        yield srv


def connect(server, tls, api_key: str | None = API_KEY) -> DisaggClient:
    return DisaggClient(server.address, api_key=api_key, tls_ca=tls[0])


def test_colocated_greedy_equals_offline(server, tls):
    llm = LLM(num_kv_blocks=400)
    prompts = [
        {"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])} for q in QUESTIONS
    ]
    expected = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    ]
    del llm
    with connect(server, tls) as client:
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


def test_colocated_cancel_frees_blocks(server, tls):
    actor = ray.get_actor(server.launcher.instances[0].actor_name, namespace=NAMESPACE)
    with connect(server, tls) as client:
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


@pytest.mark.parametrize("api_key", ["", "wrong-key"], ids=["missing", "wrong"])
def test_a_missing_or_wrong_api_key_is_unauthenticated(server, tls, api_key):
    with connect(server, tls, api_key=api_key) as client:
        for call in (lambda: client.generate(generate_request("hi", max_tokens=2), timeout=30), client.cluster_status):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED


def test_a_plaintext_client_gets_nothing_from_the_tls_server(server):
    with DisaggClient(server.address, api_key=API_KEY) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.cluster_status(timeout=5)
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_the_cli_connects_with_tls_and_the_key_from_the_environment(server, tls):
    env = {**os.environ, "DISAGG_API_KEY": API_KEY}
    command = [sys.executable, "-m", "disagg.cli", "generate", "--server", server.address, "--tls-ca", tls[0]]
    done = subprocess.run([*command, "--max-tokens", "8", "What is the capital of France?"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "Paris" in done.stdout, done.stderr
    env.pop("DISAGG_API_KEY")
    refused = subprocess.run([*command, "hi"], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


def test_health_reflection_and_metrics_ask_for_the_key(server, tls):
    """With api_key set, grpcio's health and reflection servicers and /metrics refuse a caller
    without it (health_without_key: false), and answer one with it."""

    def check(client):
        return health_pb2_grpc.HealthStub(client.channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5, metadata=client.metadata
        )

    def list_services(client):
        stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
        ask = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        return [r for r in stub.ServerReflectionInfo(ask, timeout=5, metadata=client.metadata)]

    with connect(server, tls, api_key=None) as stranger:
        for call in (check, list_services):
            with pytest.raises(grpc.RpcError) as refused:
                call(stranger)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with connect(server, tls) as member:
        assert check(member).status == health_pb2.HealthCheckResponse.SERVING
        assert list_services(member)

    trust = ssl.create_default_context(cafile=tls[0])
    assert server.metrics_url.startswith("https://")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(server.metrics_url, timeout=5, context=trust)
    assert refused.value.code == 401
    scrape = urllib.request.Request(server.metrics_url, headers={"Authorization": f"Bearer {API_KEY}"})
    assert b"disagg" in urllib.request.urlopen(scrape, timeout=5, context=trust).read()
