"""Workers die under load and no request is lost: real Ray actors killed with SIGKILL (or told
to leave with SIGTERM), a real redis-server, real gRPC on 127.0.0.1.

One server for the module: 1 prefill + 2 decode instances of the default model. A killed
decode worker's streams continue on the other decode instance (prompt + tokens so far
recomputed), with the output a fault-free run gives; Ray relaunches the dead worker, which
registers again and serves. A killed prefill worker (the only one) has its requests wait for
the relaunch and resubmitted. A decode worker sent SIGTERM drains: its requests move to the
other decode instance with their KV (nothing recomputed, output unchanged) before it exits.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import pytest
import ray
from support import chat_request, listed, stream_all, wait_listed

from disagg.client import DisaggClient
from disagg.config import ServingConfig
from disagg.server import Server

QUESTIONS = ["Write a story about a dragon.", "Describe the ocean.", "Explain how rain forms.", "Tell me about Rome."]
MAX_TOKENS = 48
RELAUNCH_TIMEOUT_S = 90


@pytest.fixture(scope="module")
def server(ray_session):
    config = ServingConfig.from_dict(
        {
            "engine": {"num_kv_blocks": 400, "max_num_batched_tokens": 256},
            "prefill": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "decode": {"num_instances": 2, "num_cpus_per_worker": 0.5},
            "port": 0,
            "metrics_port": 0,
            "heartbeat_interval_s": 0.3,
            "heartbeat_ttl_s": 1.0,
            "recovery_timeout_s": RELAUNCH_TIMEOUT_S,
            "calibration_s": 0,  # placement is not what this tests (test_calibration.py is)
            "replan": False,  # the roles these tests kill and signal stay put (test_replanning.py)
        }
    )
    with Server(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with DisaggClient(server.address) as c:
        yield c


def request(question: str, **sampling):
    return chat_request(question, **{"max_tokens": MAX_TOKENS, **sampling})


def run_all(client, requests, kill=None, after_tokens: int = 4) -> list[tuple[list[int], str]]:
    """Stream every request at once; once each has `after_tokens` tokens, call `kill()`."""
    return stream_all(client, requests, during=kill, after_tokens=after_tokens)


def worker_pid(instance) -> int:
    return ray.get(instance.actor.ready.remote(), timeout=RELAUNCH_TIMEOUT_S)["pid"]


def instances(server, role: str) -> list:
    return sorted((i for i in server.launcher.instances if i.role == role), key=lambda i: i.instance_id)


def wait_relaunched(client, instance, old_pid: int) -> float:
    """Seconds until the instance runs in a new process and the router lists it again."""
    started = time.monotonic()
    while True:
        if instance.instance_id in listed(client):
            try:
                if worker_pid(instance) != old_pid:
                    return time.monotonic() - started
            except ray.exceptions.RayActorError:
                pass  # still restarting
        assert time.monotonic() - started < RELAUNCH_TIMEOUT_S, f"{instance.instance_id} was not relaunched"
        time.sleep(0.2)


def metric(server, prefix: str) -> float:
    text = urllib.request.urlopen(f"{server.metrics_url}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def migrations(server) -> float:
    """Requests that went on elsewhere by recomputing their context."""
    return metric(server, "disagg:request_migrations_total{")


def moved_with_kv(server) -> float:
    return metric(server, 'disagg:live_moves_total{outcome="moved"}')


def signal_the_busiest_decode_worker(server, signum: int) -> dict:
    """Send `signum` to the decode worker running most streams; returns its instance, pid and streams."""
    loads = {i.instance_id: ray.get(i.actor.status.remote())["load"].num_running for i in instances(server, "decode")}
    busiest = next(i for i in instances(server, "decode") if i.instance_id == max(loads, key=loads.get))
    told = {"instance": busiest, "pid": worker_pid(busiest), "streams": max(loads.values())}
    os.kill(told["pid"], signum)
    return told


def test_a_killed_decode_worker_loses_no_request_and_comes_back(server, client):
    greedy = [request(q) for q in QUESTIONS]
    seeded = [request(q, temperature=0.8, seed=11 + i) for i, q in enumerate(QUESTIONS[:2])]
    expected = run_all(client, greedy + seeded)
    before, killed = migrations(server), {}

    got = run_all(
        client, greedy + seeded, kill=lambda: killed.update(signal_the_busiest_decode_worker(server, signal.SIGKILL))
    )

    assert killed["streams"] >= 1, "the kill must hit streams in flight"
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected], "a token repeated, missing or changed"
    assert [text for _, text in got] == [text for _, text in expected]
    assert migrations(server) - before >= killed["streams"], "every stream on the killed worker migrated"
    wait_relaunched(client, killed["instance"], killed["pid"])
    # Back in service: with the other decode instance silent, it serves alone.
    (other,) = [i for i in instances(server, "decode") if i.instance_id != killed["instance"].instance_id]
    ray.get(other.actor.set_heartbeat_enabled.remote(False))
    try:
        wait_listed(client, other.instance_id, present=False)
        final = client.generate(request(QUESTIONS[0], max_tokens=4), timeout=120)[2]
    finally:
        ray.get(other.actor.set_heartbeat_enabled.remote(True))
    assert final.timings.decode_instance == killed["instance"].instance_id
    wait_listed(client, other.instance_id, present=True)


def test_a_killed_prefill_worker_has_its_requests_resubmitted_after_its_relaunch(server, client):
    reqs = [request(q) for q in QUESTIONS[:3]]
    expected = run_all(client, reqs)
    (victim,) = instances(server, "prefill")
    pid = worker_pid(victim)
    killed = threading.Event()

    def kill_during_prefill():
        os.kill(pid, signal.SIGKILL)
        killed.set()

    # Kill as the requests are sent, so that some are in the prefill worker when it dies.
    timer = threading.Timer(0.05, kill_during_prefill)
    timer.start()
    got = run_all(client, reqs, after_tokens=1)
    timer.join()
    assert killed.is_set()
    assert got == expected
    wait_relaunched(client, victim, pid)


def test_a_decode_worker_sent_sigterm_moves_its_requests_with_their_kv(server, client):
    greedy = [request(q) for q in QUESTIONS]
    seeded = [request(q, temperature=0.8, seed=21 + i) for i, q in enumerate(QUESTIONS[:2])]
    expected = run_all(client, greedy + seeded)
    recomputed_before, moved_before, told = migrations(server), moved_with_kv(server), {}

    got = run_all(
        client, greedy + seeded, kill=lambda: told.update(signal_the_busiest_decode_worker(server, signal.SIGTERM))
    )

    assert told["streams"] >= 1, "the SIGTERM must hit streams in flight"
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected], "a token repeated, missing or changed"
    assert [text for _, text in got] == [text for _, text in expected]
    assert migrations(server) == recomputed_before, "a request recomputed its context: it should have moved with its KV"
    assert moved_with_kv(server) - moved_before >= 1
    wait_relaunched(client, told["instance"], told["pid"])  # it exited once drained; Ray brings it back
