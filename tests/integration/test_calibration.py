"""Each instance's latency model measured at `disagg serve` start (disagg.router.calibration):
predictions and SLO admission hold from the first client request, not after some traffic has
fitted the models. Real Ray, redis-server and gRPC on 127.0.0.1."""

from __future__ import annotations

import time

import grpc
import pytest

from disagg.client import DisaggClient, generate_request
from disagg.config import ServingConfig
from disagg.server import Server
from disagg.v1 import serving_pb2

CALIBRATION_S = 30.0


@pytest.fixture(scope="module")
def server(ray_session):
    config = ServingConfig.from_dict(
        {
            "engine": {"num_kv_blocks": 300, "max_num_batched_tokens": 256},
            # Two paths (prefill-0 -> decode-0, prefill-1 -> decode-0): each is swept, at once.
            "prefill": {"num_instances": 2, "num_cpus_per_worker": 0.5},
            "decode": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "port": 0,
            "heartbeat_interval_s": 0.2,
            "calibration_s": CALIBRATION_S,
            "replan": False,
        }
    )
    started = time.monotonic()
    with Server(config) as srv:
        srv.start_s = time.monotonic() - started
        yield srv


def chat(question: str, **sampling):
    return generate_request(chat=[{"role": "user", "content": question}], temperature=0.0, **sampling)


def test_every_instance_is_calibrated_before_the_server_serves(server):
    assert server.calibrated
    assert server.start_s < 120 + CALIBRATION_S  # loading the model, then the bounded measurement
    with DisaggClient(server.address) as client:
        status = client.cluster_status()
    instances = [inst for pool in status.pools for inst in pool.instances]
    assert len(instances) == 3
    for pool in status.pools:
        for inst in pool.instances:
            model = inst.latency_model
            assert model.calibrated and model.num_steps >= 8, f"{inst.instance_id}: {model}"


def test_the_first_client_requests_are_admitted_by_prediction(server):
    """The first requests any client sends: two long streams keep the cluster busy, and a
    request with a TTFT target no instance can meet is refused at once with the prediction
    (on guessed models nothing is refused; the streams alone fit no prefill model)."""
    with DisaggClient(server.address) as client:
        busy = [client.stream(chat(f"Tell a long story {i}.", max_tokens=300, ignore_eos=True)) for i in range(2)]
        try:
            for call in busy:
                next(call)  # its first token: it is decoding now
            with pytest.raises(grpc.RpcError) as refused:
                client.generate(chat("Say hi.", max_tokens=4, slo=serving_pb2.Slo(ttft_ms=0.01)))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "predicted TTFT" in refused.value.details()
        finally:
            for call in busy:
                call.cancel()
