"""Instances switch between prefill and decode inside a running server (issue 36): real Ray
actors (WorkerActor), a real redis-server, real gRPC on 127.0.0.1.

One server for the module: 1 prefill + 2 decode instances of the default model, re-planning on
but its own rounds far apart, so that the tests drive each switch (the loop's decisions are
tests/unit/test_replanner.py's). A switch under load loses nothing and changes no output: the
decoding requests of a leaving decode instance move with their KV; the instance then serves in
its new pool. A switch refused (the instance still holds requests) leaves it serving in its
old role. With two frontends, the requests frontend 1 placed move off a switching instance
too (each frontend drains its own), and the re-planner, which runs in the deployment's
controller (disagg.controller), counts every frontend's arrivals.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
import ray

from support import chat_request, stream_all

from disagg.client import DisaggClient
from disagg.config import ServingConfig
from disagg.placement.profile import load_profile
from disagg.planner.live_pricing import price_splits
from disagg.planner.replanner import Split
from disagg.planner.workload import SimRequest
from disagg.router.replan_pricer import PricingPool
from disagg.router.replanning import live_state
from disagg.server import Server

PROFILE = "deploy/profiles/smollm2-135m-cpu-1t.json"

QUESTIONS = ["Write a story about a dragon.", "Describe the ocean.", "Explain how rain forms.", "Tell me about Rome."]
FRESH_QUESTIONS = ["Name three rivers.", "What is a prime number?", "How do bees make honey?", "Why is the sky blue?"]
MAX_TOKENS = 40
LONG_MAX_TOKENS = 160  # decoding well past a switch's few seconds


@pytest.fixture(scope="module")
def server(ray_session):
    config = ServingConfig.from_dict(
        {
            "engine": {"num_kv_blocks": 400, "max_num_batched_tokens": 256},
            "prefill": {"num_instances": 1, "num_cpus_per_worker": 0.5},
            "decode": {"num_instances": 2, "num_cpus_per_worker": 0.5},
            "port": 0,
            "http_port": 0,
            "metrics_port": 0,
            "frontends": 2,  # frontend 1 (a Ray actor) sends the last test's requests
            "heartbeat_interval_s": 0.3,
            "heartbeat_ttl_s": 1.0,
            "calibration_s": 0,
            "replan_interval_s": 3600,  # the tests switch; the loop's own rounds would race them
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


def streamed_tokens(client, requests, during=None) -> list[list[int]]:
    """Every request at once (`during()` once each has 4 tokens): each one's tokens."""
    return [tokens for tokens, _ in stream_all(client, requests, during)]


def switch(server, from_role: str, to_role: str, timeout_s: float = 120):
    """One switch now, by the deployment's controller (which runs the re-planner)."""
    return server.launcher.replan_switch(from_role, to_role, timeout_s)


def arrivals_seen(server) -> list:
    """The re-planner's window, the frontends' arrivals taken into it first."""
    return server.launcher.replan_take_arrivals()


def pools(client) -> dict[str, list[str]]:
    status = client.cluster_status()
    return {p.role: sorted(i.instance_id for i in p.instances) for p in status.pools}


def workload():
    greedy = [request(q) for q in QUESTIONS]
    seeded = [request(q, temperature=0.8, seed=7 + i) for i, q in enumerate(QUESTIONS[:2])]
    return greedy + seeded


def test_switches_under_load_there_and_back_lose_nothing_and_change_no_output(server, client):
    assert client.cluster_status().replan
    requests = workload()
    expected = streamed_tokens(client, requests)
    switches = []

    to_prefill = streamed_tokens(
        client,
        requests,
        during=lambda: switches.append(switch(server, "decode", "prefill")),
    )
    assert to_prefill == expected, "a token repeated, missing or changed across the switch"
    assert switches[0].outcome == "done", switches[0].reason
    moved = switches[0].instance_id
    assert moved in pools(client)["prefill"] and len(pools(client)["decode"]) == 1
    assert [i.role for i in server.launcher.instances if i.instance_id == moved] == ["prefill"]

    # It prefills now: fresh prompts (the old ones are cached on the first prefill instance, and
    # go there) are placed over both prefill instances, and come out as they do a second time.
    fresh = [request(q) for q in FRESH_QUESTIONS]
    assert streamed_tokens(client, fresh) == streamed_tokens(client, fresh)
    actor = ray.get_actor(f"disagg-{moved}", namespace="disagg")
    assert ray.get(actor.status.remote())["kv_bytes_sent"] > 0, "the switched instance never prefilled"

    back = streamed_tokens(
        client,
        requests,
        during=lambda: switches.append(switch(server, "prefill", "decode")),
    )
    assert back == expected
    assert switches[1].outcome == "done", switches[1].reason
    assert len(pools(client)["prefill"]) == 1 and len(pools(client)["decode"]) == 2
    assert all(s.seconds < 30 for s in switches)
    # The controller's re-planning metrics, on the frontend's endpoint (it has no port of its own).
    both = 'disagg:replan_switches_total{outcome="done"} 2.0'
    assert both in metrics_soon(server, both)


def metrics_soon(server, wanted: str, timeout_s: float = 10.0) -> str:
    """The frontend's metrics text once it shows `wanted` (it fetches the controller's every 2 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
        if wanted in text or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def test_a_switch_refused_while_the_instance_holds_requests_leaves_it_serving_in_its_role(server, client):
    requests = workload()
    expected = streamed_tokens(client, requests)
    decodes = [i for i in server.launcher.instances if i.role == "decode"]
    refusals = []

    def refuse():
        busiest = max(decodes, key=lambda i: ray.get(i.actor.status.remote())["load"].num_running)
        try:
            ray.get(busiest.actor.switch_role.remote("prefill"), timeout=30)
        except Exception as exc:  # noqa: BLE001 - Ray wraps the worker's ValueError
            refusals.append((busiest.instance_id, str(exc)))

    assert streamed_tokens(client, requests, during=refuse) == expected
    assert refusals and "drain it first" in refusals[0][1]
    assert refusals[0][0] in pools(client)["decode"]
    time.sleep(1)  # a heartbeat or three: it is still registered, as decode
    assert refusals[0][0] in pools(client)["decode"]
    assert streamed_tokens(client, requests) == expected


def decode_running(server) -> int:
    """Requests decoding now on the decode instances, as their workers say."""
    decodes = [i for i in server.launcher.instances if i.role == "decode"]
    return sum(ray.get(i.actor.status.remote(), timeout=30)["load"].num_running for i in decodes)


def test_another_frontends_requests_move_off_a_switching_instance_and_are_planned_for(server):
    counted = len(arrivals_seen(server))  # what earlier tests left
    since = time.monotonic()
    requests = [request(q, max_tokens=LONG_MAX_TOKENS) for q in QUESTIONS]
    with DisaggClient(server.frontend_addresses()[1]) as replica:
        expected = streamed_tokens(replica, requests)
        switches, running_after = [], []

        def switch_now():
            switches.append(switch(server, "decode", "prefill"))
            running_after.append(decode_running(server))

        assert streamed_tokens(replica, requests, during=switch_now) == expected
    assert switches[0].outcome == "done", switches[0].reason
    # The switched instance held none of them when it switched, yet all were still decoding: its
    # share had moved to the other decode instance (not waited out: without frontend 1's drain
    # the switch waits for them to end).
    assert running_after == [len(requests)]
    time.sleep(1.5)  # frontend 1's feed writes every second
    arrivals = arrivals_seen(server)[counted:]
    assert len(arrivals) == 2 * len(requests), "the controller's window counts frontend 1's requests"
    assert all(since - 1 <= at <= time.monotonic() for at, *_ in arrivals)
    back = switch(server, "prefill", "decode")
    assert back.outcome == "done", back.reason


def test_a_round_prices_every_split_from_the_live_state_in_a_process_of_its_own(server, client):
    """Issue 53: the workers' reports carry their decodes in flight; the live state built from
    them prices every split in the spawned pricing process."""
    loop = server.launcher.controller.replanning  # (the controller runs in the test's process)
    profile = load_profile(PROFILE)
    seen = []

    def during():
        time.sleep(0.7)  # a heartbeat or two after every request decodes
        seen.append(live_state(loop.directory, profile, typical_remaining=8))

    streamed_tokens(client, workload(), during=during)
    live = seen[0]
    roles = [i.role for i in server.launcher.instances]
    assert live.split == Split(roles.count("prefill"), roles.count("decode"))
    assert sum(len(i.decodes) for i in live.by_role("decode")) >= 3, live
    assert all(
        d.context_tokens > 4 and 1 <= d.remaining_tokens <= MAX_TOKENS for i in live.instances for d in i.decodes
    )
    requests = [SimRequest(k, k * 0.2, 30, 20) for k in range(10)]
    pool = PricingPool(timeout_s=60.0)
    try:
        priced = asyncio.run(
            pool.run(price_splits, loop.config, {"prefill": profile, "decode": profile}, live, requests, 2.0)
        )
    finally:
        pool.close()
    assert set(priced) == {Split(1, 2), Split(2, 1)} and all(0 <= p.attainment <= 100 for p in priced.values())


def test_the_controller_adds_an_instance_where_ray_has_room_and_removes_one_under_load_losing_nothing(server, client):
    """Scaling (issue 53, item 3) on the real cluster: 1.5 of its 2 CPUs taken, room for one more
    instance of 0.5; the one removed is drained while requests stream (they move or finish)."""
    started = time.monotonic()
    loop = server.launcher.controller.replanning
    assert loop.scaler is not None and loop.scaler.room_for("decode")
    added = server.launcher.replan_scale("decode", 1)
    assert added.kind == "add" and added.outcome == "done", added.reason
    deadline = time.monotonic() + 10
    while added.instance_id not in pools(client).get("decode", []) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert added.instance_id in pools(client)["decode"] and loop.current_split() == Split(1, 3)
    print(f"added {added.instance_id} in {added.seconds:.1f} s ({time.monotonic() - started:.1f} s)")
    requests = [request(q) for q in QUESTIONS[:2]]  # greedy: the same tokens wherever they decode
    expected = streamed_tokens(client, requests)
    removed = []
    during = streamed_tokens(
        client, requests, during=lambda: removed.append(server.launcher.replan_scale("decode", -1))
    )
    assert during == expected, "a token repeated, missing or changed across the removal"
    assert removed[0].kind == "remove" and removed[0].outcome == "done", removed[0].reason
    assert loop.current_split() == Split(1, 2) and len(server.launcher.instances) == 3
    print(
        f"removed {removed[0].instance_id} in {removed[0].seconds:.1f} s; the test {time.monotonic() - started:.1f} s"
    )
