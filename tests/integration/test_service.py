"""The service end to end: real Ray actors, a real redis-server, real gRPC on 127.0.0.1.

One server for the module (default model, 1 prefill + 2 decode instances); tests that change
its state (heartbeats) put it back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
import ray
import redis
from support import listed, wait_listed
from grpc_health.v1 import health_pb2, health_pb2_grpc

from disagg import LLM, SamplingParams
from disagg.client import DisaggClient, generate_request
from disagg.cluster.launcher import NAMESPACE
from disagg.server import Server
from disagg.config import ServingConfig
from disagg.registry import Registry
from disagg.v1 import serving_pb2

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about rain.",
    "Who wrote Hamlet?",
    "What is the boiling point of water?",
    "Say hello in Spanish.",
    "List two planets.",
    "What is a cat?",
    "Translate 'thank you' to French.",
    "How many days are in a week?",
    "What color is the sky?",
    "Give me a synonym for happy.",
    "What is the opposite of cold?",
    "Name a fruit that is yellow.",
    "What do bees make?",
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def server(ray_session):
    config = ServingConfig.from_dict(
        {
            "engine": {"num_kv_blocks": 400, "max_num_batched_tokens": 256},
            "prefill": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "decode": {"num_instances": 2, "num_cpus_per_worker": 0.5},
            "port": 0,
            "metrics_port": 0,
            "max_inflight_requests": 20,
            "admission_timeout_s": 5,
            "heartbeat_interval_s": 0.3,
            "heartbeat_ttl_s": 1.0,
            "recovery_timeout_s": 3.0,  # how long requests wait for a pool that emptied to refill
            "replan": False,  # a switch would move instances these tests count on (test_replanning.py)
            # These tests count on which instance prefills: a prompt asked again is not prefilled on
            # the decode instance holding its answer (test_conditional_disaggregation.py's).
            "decode_reuse_max_tokens": 0,
            "calibration_s": 0,  # placement's measured models are test_calibration.py's
        }
    )
    with Server(config) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with DisaggClient(server.address) as c:
        yield c


def chat(question: str, **sampling):
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("max_tokens", MAX_TOKENS)
    return generate_request(chat=[{"role": "user", "content": question}], **sampling)


def actors(server) -> list:
    return [ray.get_actor(inst.actor_name, namespace=NAMESPACE) for inst in server.launcher.instances]


def wait_all_blocks_free(server, timeout_s: float) -> float:
    """Seconds until every worker reports every KV block free (fails after timeout_s)."""
    started = time.monotonic()
    while True:
        loads = [ray.get(a.status.remote())["load"] for a in actors(server)]
        if all(load.num_free_blocks == load.num_total_blocks for load in loads):
            return time.monotonic() - started
        assert time.monotonic() - started < timeout_s, (
            f"blocks still held: {[(l.num_free_blocks, l.num_total_blocks) for l in loads]}"
        )
        time.sleep(0.05)


def test_start_sends_a_warm_up_request_through_every_instance(server):
    # Before serving, so that no client's first request pays for dialling links, the KV pair and
    # first kernels (disagg.router.warm_up).
    assert {name for pair in server.warmed_up for name in pair} == {
        inst.instance_id for inst in server.launcher.instances
    }


def test_greedy_over_grpc_equals_offline_with_16_concurrent_clients(server, client):
    llm = LLM(num_kv_blocks=400)
    prompts = [
        {"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])} for q in QUESTIONS
    ]
    expected = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    ]
    del llm
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda q: client.generate(chat(q), timeout=120), QUESTIONS))
    assert [tokens for tokens, _, _ in results] == expected
    paris = results[0][1]
    assert "Paris" in paris
    for tokens, _, final in results:
        assert final.finished and final.usage.completion_tokens == len(tokens)
        assert 0 < final.timings.ttft_s <= final.timings.e2e_s
    assert {final.timings.decode_instance for _, _, final in results} <= {
        i.instance_id for i in server.launcher.instances
    }
    wait_all_blocks_free(server, 5)


def test_stream_messages_carry_tokens_as_produced(client):
    messages = list(client.stream(chat("Count from one to ten.", max_tokens=24, ignore_eos=True), timeout=60))
    assert len(messages) >= 3, "tokens arrive over several messages, not all at the end"
    assert [m.finished for m in messages] == [False] * (len(messages) - 1) + [True]
    assert sum(len(m.token_ids) for m in messages) == 24
    assert messages[-1].finish_reason == "length"


def test_client_cancel_mid_stream_frees_every_block_within_a_second(server, client):
    call = client.stream(chat("Tell me a very long story about dragons.", max_tokens=300, ignore_eos=True))
    next(call)
    next(call)  # decoding is under way
    call.cancel()
    assert wait_all_blocks_free(server, 1.5) < 1.5


def test_abort_ends_the_stream_at_once_with_finish_reason_abort_and_frees_the_id(server, client):
    for when in ("decoding", "prefilling"):
        request = chat("Tell me a very long story about dragons.", max_tokens=300, ignore_eos=True)
        request.request_id = f"abort-me-{when}"
        call = client.stream(request, timeout=60)
        if when == "decoding":
            next(call)
        else:
            time.sleep(0.05)
        started = time.monotonic()
        assert client.abort(request.request_id)
        last = list(call)[-1]
        assert time.monotonic() - started < 2.0, "the stream ends when the request is aborted"
        assert last.finished and last.finish_reason == "abort"
        wait_all_blocks_free(server, 1.5)
        tokens, _, _ = client.generate(chat("What is 2 + 2?", max_tokens=2, request_id=request.request_id), timeout=60)
        assert tokens, "an aborted request's id is free again at once"


def test_deadline_exceeded_aborts_and_frees_blocks(server, client):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(chat("Tell me a very long story about castles.", max_tokens=300, ignore_eos=True), timeout=1.0)
    assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_all_blocks_free(server, 1.5)


def test_requests_cancelled_during_the_handshake_free_their_blocks_at_once(server, client):
    """Deadlines so short that many requests end while the decode side is still reserving: the
    reservation it makes is aborted, not left to wait out the KV deadline."""
    busy = [client.stream(chat("Write a long story.", max_tokens=120, ignore_eos=True)) for _ in range(4)]
    for call in busy:
        next(call)  # the decode engines are stepping: a reservation waits for the step under way
    for deadline_s in (0.001, 0.003, 0.01, 0.03):
        for i in range(25):
            with pytest.raises(grpc.RpcError):
                client.generate(chat(f"Tell me about {i}.", max_tokens=50, ignore_eos=True), timeout=deadline_s)
    for call in busy:
        call.cancel()
    wait_all_blocks_free(server, 3.0)


BAD_REQUESTS = {
    "empty prompt": generate_request(""),
    "no input": generate_request(),
    "empty chat": generate_request(chat=[]),
    "bad chat role": generate_request(chat=[{"role": "wizard", "content": "hi"}]),
    "token id out of range": generate_request(prompt_token_ids=[1, 10**7]),
    "temperature < 0": generate_request("hi", temperature=-0.5),
    "top_p = 0": generate_request("hi", top_p=0.0),
    "top_p > 1": generate_request("hi", top_p=1.5),
    "top_k < -1": generate_request("hi", top_k=-2),
    "max_tokens < 1": generate_request("hi", max_tokens=0),
    "prompt too long": generate_request(prompt_token_ids=[1] * 9000),
    "prompt + max_tokens too long": generate_request(prompt_token_ids=[1] * 8000, max_tokens=500),
    "top_k > vocabulary": generate_request("hi", top_k=2**31 - 1),
    "request_id like a retry's": generate_request("hi", request_id="mine~1"),
    "request_id unprintable": generate_request("hi", request_id="a\nb"),
    "request_id too long": generate_request("hi", request_id="x" * 10_000),
    "temperature infinite": generate_request("hi", temperature=float("inf")),
    "slo negative": generate_request("hi", slo=serving_pb2.Slo(ttft_ms=-1)),
    "slo not a number": generate_request("hi", slo=serving_pb2.Slo(tpot_ms=float("nan"))),
    "stop token beyond vocabulary": generate_request("hi", stop_token_ids=[10**6]),
    "text that cannot fit": generate_request("word " * 60_000),
}
FIELD_NAMED = {
    "temperature < 0": "temperature",
    "top_p = 0": "top_p",
    "top_p > 1": "top_p",
    "top_k < -1": "top_k",
    "top_k > vocabulary": "top_k",
    "stop token beyond vocabulary": "stop_token_ids",
    "text that cannot fit": "prompt",
    "max_tokens < 1": "max_tokens",
    "bad chat role": "role",
    "token id out of range": "prompt_token_ids",
    "request_id like a retry's": "request_id",
    "request_id unprintable": "request_id",
    "request_id too long": "request_id",
    "temperature infinite": "temperature",
    "slo negative": "slo.ttft_ms",
    "slo not a number": "slo.tpot_ms",
}


def test_undecodable_bytes_are_invalid_argument_on_every_method(server, client):
    for method, stream in (("Generate", True), ("Abort", False), ("ClusterStatus", False)):
        path = f"/disagg.v1.Serving/{method}"
        call = (client.channel.unary_stream if stream else client.channel.unary_unary)(
            path, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw
        )
        with pytest.raises(grpc.RpcError) as err:
            reply = call(b"\xff\xff\xff\xff", timeout=10)
            list(reply) if stream else reply
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, method
        assert "could not be decoded" in err.value.details()
    tokens, _, _ = client.generate(chat("What is 2 + 2?", max_tokens=2), timeout=60)
    assert tokens


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_the_next_request_succeeds(client, case):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(BAD_REQUESTS[case], timeout=30)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    if case in FIELD_NAMED:
        assert FIELD_NAMED[case] in err.value.details()
    tokens, _, final = client.generate(chat("What is 2 + 2?", max_tokens=4), timeout=60)
    assert final.finished and len(tokens) >= 1


def test_full_admission_queue_is_resource_exhausted_then_serving_resumes(server, client):
    calls = [client.stream(chat("Write a long poem.", max_tokens=200, ignore_eos=True)) for _ in range(26)]
    codes = []
    lock = threading.Lock()

    def first_message(call):
        try:
            next(call)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
        with lock:
            codes.append(code)

    with ThreadPoolExecutor(26) as pool:
        list(pool.map(first_message, calls))
    for call in calls:
        call.cancel()
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 6
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    wait_all_blocks_free(server, 5)
    tokens, _, _ = client.generate(chat("What is 2 + 2?", max_tokens=4), timeout=60)
    assert tokens


def decode_instances(server) -> list:
    return sorted((i for i in server.launcher.instances if i.role == "decode"), key=lambda i: i.instance_id)


@contextlib.contextmanager
def heartbeat_silenced(client, instance):
    """The instance stops heartbeating until the block ends; yields once the router has dropped it."""
    ray.get(instance.actor.set_heartbeat_enabled.remote(False))
    try:
        wait_listed(client, instance.instance_id, present=False)
        yield
    finally:
        ray.get(instance.actor.set_heartbeat_enabled.remote(True))
    wait_listed(client, instance.instance_id, present=True)


def decode_instances_chosen(client) -> set[str]:
    finals = [client.generate(chat(q, max_tokens=3), timeout=60)[2] for q in QUESTIONS[:4]]
    return {f.timings.decode_instance for f in finals}


def test_decode_worker_whose_heartbeat_stops_is_not_chosen_until_it_returns(server, client):
    first, second = decode_instances(server)
    with heartbeat_silenced(client, first):
        assert decode_instances_chosen(client) == {second.instance_id}
    # The first is back. Which of two healthy instances the router prefers is its model's call,
    # so silence the second: requests must now go to the first, proving it is placed again.
    with heartbeat_silenced(client, second):
        assert decode_instances_chosen(client) == {first.instance_id}


def health_status(client, wait_for=None, timeout_s: float = 5):
    """The server's health; with `wait_for`, polled until it is that status (or timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = (
            health_pb2_grpc.HealthStub(client.channel)
            .Check(health_pb2.HealthCheckRequest(service="disagg.v1.Serving"), timeout=5)
            .status
        )
        if wait_for is None or status == wait_for or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


def test_no_healthy_decode_instance_is_unavailable_and_not_serving(server, client):
    instances = decode_instances(server)
    for inst in instances:
        ray.get(inst.actor.set_heartbeat_enabled.remote(False))
    try:
        for inst in instances:
            wait_listed(client, inst.instance_id, present=False)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            client.generate(chat("hi", max_tokens=2), timeout=30)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started > 2.0, "it waited recovery_timeout_s for the pool to refill"
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        assert health_status(client, wait_for=not_serving) == not_serving, "a pool is empty"
    finally:
        for inst in instances:
            ray.get(inst.actor.set_heartbeat_enabled.remote(True))
    for inst in instances:
        wait_listed(client, inst.instance_id, present=True)
    assert client.generate(chat("hi", max_tokens=2), timeout=60)[0]
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health_status(client, wait_for=serving) == serving


def test_cluster_status_health_and_reflection(server, client):
    status = client.cluster_status()
    roles = {p.role: len(p.instances) for p in status.pools}
    assert roles == {"prefill": 1, "decode": 2} and status.mode == "disaggregated"
    for pool in status.pools:
        for inst in pool.instances:
            assert inst.num_total_blocks == 400 and inst.tensor_parallel_size == 1
    assert health_status(client) == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    services = {s.name for r in responses for s in r.list_services_response.service}
    assert "disagg.v1.Serving" in services


def test_cluster_status_shows_how_kv_goes_between_instances(server, client):
    """Each pair's path is chosen once, from both sides' devices: CPU caches on one host, so the
    decode side copies the prefill's KV out of its shared memory."""
    assert client.generate(chat("Name a colour.", max_tokens=2), timeout=60)[0]
    deadline = time.monotonic() + 15  # the next heartbeats carry the new pair
    while time.monotonic() < deadline:
        pools = {p.role: p.instances for p in client.cluster_status().pools}
        prefill_paths = dict(pools["prefill"][0].kv_paths)
        decode_paths = {peer: path for inst in pools["decode"] for peer, path in inst.kv_paths.items()}
        if prefill_paths and decode_paths:
            break
        time.sleep(0.5)
    decode_ids = {inst.instance_id for inst in pools["decode"]}
    assert set(prefill_paths) <= decode_ids and set(prefill_paths.values()) == {"shared memory"}, prefill_paths
    assert pools["prefill"][0].instance_id in decode_paths and set(decode_paths.values()) == {"shared memory"}


def test_cluster_status_shows_the_kv_tiers_and_the_prefix_index(server, client):
    """The prefill instance's cached prompt blocks reach the cluster-wide index in Redis, and
    the router's read of it shows in `disagg status` beside the tiers' figures."""
    assert client.generate(chat("List three prime numbers, briefly.", max_tokens=2), timeout=60)[0]
    deadline, tiers = time.monotonic() + 15, {}
    while time.monotonic() < deadline:
        tiers = dict(next(p for p in client.cluster_status().pools if p.role == "prefill").instances[0].kv_tiers)
        if tiers.get("index.entries", 0) > 0:
            break
        time.sleep(0.5)
    assert tiers.get("index.entries", 0) > 0 and tiers["index.complete"] == 1.0, tiers
    assert "hit_blocks.host" in tiers and "held_bytes.host" in tiers


def scrape(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_prometheus_metrics_from_frontend_and_workers(server, client):
    client.generate(chat("What is 2 + 2?", max_tokens=4), timeout=60)
    time.sleep(1.2)  # the worker gauges refresh every second
    values = scrape(server)
    assert values["disagg:time_to_first_token_seconds_count"] >= 1
    assert values["disagg:e2e_request_latency_seconds_count"] >= 1
    assert values["disagg:inter_token_latency_seconds_count"] >= 1
    assert values["disagg:kv_transfer_seconds_count"] >= 1 and values["disagg:kv_transfer_bytes_total"] > 0
    roles = {name.split('role="')[1].split('"')[0] for name in values if name.startswith("disagg:kv_cache_usage_perc{")}
    assert roles == {"prefill", "decode"}
    assert any(name.startswith("disagg:num_requests_running{") for name in values)
    assert values['disagg:request_failure_total{code="INVALID_ARGUMENT"}'] >= 1  # from the bad-input tests


def test_finished_request_is_recorded_and_leaves_no_block_held(server, client):
    """A request that finished gets no abort calls: its end alone must free every block."""
    client.generate(
        generate_request(
            chat=[{"role": "user", "content": "Name a color."}],
            request_id="recorded-1",
            temperature=0.0,
            max_tokens=6,
            ignore_eos=True,
        ),
        timeout=60,
    )
    wait_all_blocks_free(server, timeout_s=2.0)
    with Registry(server.redis.url) as registry:
        deadline = time.monotonic() + 5
        while not (found := [r for r in registry.recent_requests() if r["request_id"] == "recorded-1"]):
            assert time.monotonic() < deadline, "no record of the finished request in Redis"
            time.sleep(0.1)
    assert found[0]["completion_tokens"] == 6 and found[0]["finish_reason"] == "length"
    assert 0 < found[0]["ttft_s"] < found[0]["e2e_s"]


LOOPBACK_ADDRESSES = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
RAY_DASHBOARD_PORT = 8265


def test_no_secret_on_a_command_line_or_in_redis_and_our_ports_on_loopback(server):
    secrets = {"the Redis password": server.redis.password, "the link key": server._link_key.hex()}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(proc.info["cmdline"] or [])
        for name, secret in secrets.items():
            assert secret not in command, f"{name} is on the command line of pid {proc.info['pid']}"
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=server.redis.port, socket_timeout=5).ping()
    client = redis.Redis.from_url(server.redis.url, socket_timeout=5)
    stored = b" ".join(client.get(key) or b"" for key in client.scan_iter(count=1000) if client.type(key) == b"string")
    assert stored and server._link_key.hex().encode() not in stored and b"rpc_token" not in stored
    client.close()
    with Registry(server.redis.url) as registry:
        infos = [view.info for view in registry.instances()]
    ours = {
        int(server.address.rsplit(":", 1)[1]),
        int(server.metrics_url.split(":")[2].split("/")[0]),
        server.redis.port,
    }
    for info in infos:
        ours |= {int(info.rpc_address.rsplit(":", 1)[1]), int(info.kv_address.rsplit(":", 1)[1])}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    for conn in listening:
        if conn.laddr.port in ours:
            assert conn.laddr.ip in LOOPBACK_ADDRESSES, f"port {conn.laddr.port} listens on {conn.laddr.ip}"
    assert len(ours) == 3 + 2 * len(infos) and {c.laddr.port for c in listening} >= ours
    assert RAY_DASHBOARD_PORT not in {c.laddr.port for c in listening}, "Ray's dashboard is up"


def test_losing_redis_fails_no_request_and_it_comes_back_by_itself(server, client):
    """Last in the module: it kills Redis. Requests in flight never touch it; the router keeps its
    last view meanwhile; the server restarts it (same port and password) and the workers'
    heartbeats fill it again."""
    call = client.stream(chat("Tell me about the sea.", max_tokens=40, ignore_eos=True), timeout=120)
    tokens = list(next(call).token_ids)
    restarts = server.redis.restarts
    os.kill(server.redis.pid, signal.SIGKILL)
    for msg in call:
        tokens += msg.token_ids
    assert len(tokens) == 40, "the request in flight finished without Redis"
    assert client.generate(chat("What is 2 + 2?", max_tokens=4), timeout=60)[0], "the router kept its last view"
    deadline = time.monotonic() + 15
    while server.redis.restarts == restarts or len(listed(client)) < 3:
        assert time.monotonic() < deadline, "Redis was not restarted, or the workers did not re-register in it"
        time.sleep(0.2)
    with Registry(server.redis.url) as registry:
        assert len(registry.instances()) == 3


def test_a_request_no_instance_can_serve_in_time_is_refused_at_once_with_the_prediction(client):
    """SLO admission over real gRPC: once the instances' models are fitted from their own steps,
    a request whose TTFT target no pair can meet gets RESOURCE_EXHAUSTED at once, naming the
    predicted TTFT; the same request as critical is served."""
    for i in range(10):  # steps for every instance's online fit (a prefill step and decode steps each)
        client.generate(chat(f"Count to {i}.", max_tokens=12, ignore_eos=True))
    time.sleep(1.0)  # the steps reach the router with the workers' next heartbeats
    # Nothing is refused while the cluster is idle (nothing to shed): keep it busy.
    busy = [client.stream(chat(f"Tell a long story {i}.", max_tokens=400, ignore_eos=True)) for i in range(2)]
    for call in busy:
        next(call)  # its first token: it is decoding now
    try:
        impossible = serving_pb2.Slo(ttft_ms=0.01)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(chat("Say hi.", slo=impossible))
        assert time.monotonic() - started < 2.0
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "predicted TTFT" in refused.value.details()
        _, _, last = client.generate(chat("Say hi.", slo=impossible, priority="critical"))
        assert last.finished and last.timings.predicted_ttft_s > 0
    finally:
        for call in busy:
            call.cancel()


def in_pool(client, instance_id: str, role: str, timeout_s: float = 10) -> None:
    """Until ClusterStatus lists the instance in `role`'s pool."""
    deadline = time.monotonic() + timeout_s
    while True:
        pools = {i.instance_id: pool.role for pool in client.cluster_status().pools for i in pool.instances}
        if pools.get(instance_id) == role:
            return
        assert time.monotonic() < deadline, f"{instance_id} is not in the {role} pool: {pools}"
        time.sleep(0.1)


def switched(server, client, instance, role: str) -> None:
    """What the re-planner does to switch an instance, from here: out of placement, drained, the
    role switched on its engine thread once it holds nothing, back in placement in its new pool."""
    loop, directory = server._loop, server.directory
    loop.call_soon_threadsafe(directory.hold_out, instance.instance_id)
    ray.get(instance.actor.drain.remote())
    deadline = time.monotonic() + 30
    while True:
        try:
            assert ray.get(instance.actor.switch_role.remote(role)) is True
            break
        except ray.exceptions.RayTaskError as exc:
            assert "drain it first" in str(exc) and time.monotonic() < deadline, exc
            time.sleep(0.1)
    ray.get(instance.actor.resume_service.remote())
    loop.call_soon_threadsafe(directory.release, instance.instance_id)
    server.launcher.switched(instance.instance_id, role)
    in_pool(client, instance.instance_id, role)


def test_a_worker_of_a_deployment_without_replanning_switches_roles_and_back(server, client):
    """Every worker is the one actor class that holds its role (disagg.worker.actor), not only
    where re-planning runs: a decode instance of this deployment (replan off) switches to prefill
    in its own process, prefills requests there, and switches back; requests run throughout."""
    (prefill,) = [i for i in server.launcher.instances if i.role == "prefill"]
    _, leaving = decode_instances(server)
    pid = ray.get(leaving.actor.ready.remote())["pid"]
    switched(server, client, leaving, "prefill")
    try:
        with heartbeat_silenced(client, prefill):  # the switched instance is the only prefill one now
            finals = [client.generate(chat(q, max_tokens=3), timeout=60)[2] for q in QUESTIONS[:3]]
        assert {f.timings.prefill_instance for f in finals} == {leaving.instance_id}
    finally:
        switched(server, client, leaving, "decode")
    assert ray.get(leaving.actor.ready.remote())["pid"] == pid, "it switched in place, weights and all"
    tokens, _, last = client.generate(chat("What is 2 + 2?", max_tokens=4), timeout=60)
    assert tokens and last.finished
