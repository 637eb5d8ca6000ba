"""Registry against a real redis-server: heartbeats with TTL, role filter, request records, failures."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from disagg.cluster.redis_server import LocalRedis, wait_for_redis
from disagg.errors import RegistryUnavailable
from disagg.registry import InstanceInfo, LoadReport, Registry
from disagg.router.records import RequestRecords
from disagg.router.shared_arrivals import ArrivalFeed, VerdictFeed, take_shared_arrivals, take_shared_verdicts
from disagg.slo import SLO
from disagg.worker.heartbeat import Heartbeat

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def registry(redis_url):
    # A namespace per test: the session's redis-server is shared.
    with Registry(redis_url, namespace=f"test-{uuid.uuid4().hex[:8]}") as reg:
        yield reg


def _info(instance_id: str, role: str = "prefill") -> InstanceInfo:
    return InstanceInfo(
        instance_id=instance_id, role=role, actor_name=f"actor-{instance_id}", kv_address="127.0.0.1:29500",
        model="smollm2-135m", tensor_parallel_size=2, started_at=time.time(),
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _process_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _process_gone(pid):
            return True
        time.sleep(0.05)
    return _process_gone(pid)


def test_heartbeat_then_instances_shows_info_load_and_age(registry):
    load = LoadReport(num_running=3, num_waiting=1, queued_prefill_tokens=512, num_free_blocks=90,
                      num_total_blocks=100, kv_cache_usage=0.1, updated_at=time.time())  # fmt: skip
    registry.heartbeat(_info("p0"), load, ttl_s=10)
    time.sleep(0.2)
    (view,) = registry.instances()
    assert view.info.instance_id == "p0" and view.info.role == "prefill"
    assert view.info.actor_name == "actor-p0" and view.info.tensor_parallel_size == 2
    assert view.load == load
    assert 0.15 <= view.heartbeat_age_s < 2.0

    registry.heartbeat(_info("p0"), LoadReport(num_running=5), ttl_s=10)  # refresh: new load, age ~0
    (view,) = registry.instances()
    assert view.load.num_running == 5
    assert view.heartbeat_age_s < 0.15


def test_role_filter(registry):
    registry.heartbeat(_info("p0", "prefill"), LoadReport(), ttl_s=10)
    registry.heartbeat(_info("d0", "decode"), LoadReport(), ttl_s=10)
    registry.heartbeat(_info("d1", "decode"), LoadReport(), ttl_s=10)
    assert [v.info.instance_id for v in registry.instances()] == ["d0", "d1", "p0"]
    assert [v.info.instance_id for v in registry.instances("decode")] == ["d0", "d1"]
    assert [v.info.instance_id for v in registry.instances("prefill")] == ["p0"]
    assert registry.instances("colocated") == []
    with pytest.raises(ValueError):
        registry.heartbeat(_info("x", "router"), LoadReport(), ttl_s=10)


def test_instance_disappears_after_ttl_and_reappears_on_heartbeat(registry):
    registry.heartbeat(_info("p0"), LoadReport(), ttl_s=1.0)
    started = time.monotonic()
    time.sleep(0.5)
    assert len(registry.instances()) == 1  # still within its lease
    while registry.instances() and time.monotonic() - started < 3.0:
        time.sleep(0.05)
    assert registry.instances() == []
    assert 0.9 <= time.monotonic() - started < 2.0

    registry.heartbeat(_info("p0"), LoadReport(num_waiting=2), ttl_s=1.0)
    (view,) = registry.instances()
    assert view.load.num_waiting == 2


def test_deregister(registry):
    registry.heartbeat(_info("p0"), LoadReport(), ttl_s=10)
    registry.heartbeat(_info("d0", "decode"), LoadReport(), ttl_s=10)
    registry.deregister("p0")
    registry.deregister("p0")  # unknown id: no error
    assert [v.info.instance_id for v in registry.instances()] == ["d0"]


def test_a_departure_is_told_from_a_lapse_until_the_instance_is_back(registry):
    registry.heartbeat(_info("p0"), LoadReport(), ttl_s=10)
    registry.heartbeat(_info("lapsing"), LoadReport(), ttl_s=0.05)
    registry.deregister("p0")
    time.sleep(0.1)
    assert registry.instances() == []
    assert registry.departed(["p0", "lapsing", "never-seen"]) == {"p0"}
    registry.heartbeat(_info("p0"), LoadReport(), ttl_s=10)  # back (e.g. resumed after a drain)
    assert registry.departed(["p0"]) == set()
    registry.deregister("p0", remember_s=0.05)
    time.sleep(0.1)
    assert registry.departed(["p0"]) == set()  # the note is bounded in time too


def test_the_controllers_key_lapses_unless_refreshed_and_goes_when_it_stops(registry):
    assert not registry.controller_alive()
    registry.controller_heartbeat(ttl_s=0.3)
    assert registry.controller_alive()
    time.sleep(0.5)
    assert not registry.controller_alive(), "a controller that stopped beating is gone"
    registry.controller_heartbeat(ttl_s=30)
    registry.controller_gone()
    assert not registry.controller_alive()


def test_namespaces_are_isolated(redis_url, registry):
    registry.heartbeat(_info("p0"), LoadReport(), ttl_s=10)
    with Registry(redis_url, namespace=f"other-{uuid.uuid4().hex[:8]}") as other:
        assert other.instances() == []


def test_recent_requests_newest_first_with_limit(redis_url):
    with Registry(redis_url, namespace=f"test-{uuid.uuid4().hex[:8]}", max_request_records=5) as registry:
        assert registry.recent_requests() == []
        for i in range(8):
            registry.record_request({"request_id": f"r{i}", "ttft_s": 0.01 * i, "finish_reason": "stop"})
        assert [r["request_id"] for r in registry.recent_requests(limit=3)] == ["r7", "r6", "r5"]
        assert [r["request_id"] for r in registry.recent_requests()] == ["r7", "r6", "r5", "r4", "r3"]  # capped
        assert registry.recent_requests()[0] == {"request_id": "r7", "ttft_s": 0.07, "finish_reason": "stop"}
        assert registry.recent_requests(limit=0) == []


def test_request_records_expire(registry):
    registry.record_request({"request_id": "r0"}, ttl_s=0.3)
    assert len(registry.recent_requests()) == 1
    time.sleep(0.5)
    assert registry.recent_requests() == []


def test_request_records_are_written_in_batches_newest_first(registry):
    records = RequestRecords(registry, interval_s=0.2)
    for i in range(3):
        records.add({"request_id": f"r{i}"})
    assert registry.recent_requests() == [], "nothing is written on the caller's thread"
    deadline = time.monotonic() + 5
    while len(registry.recent_requests()) < 3:
        assert time.monotonic() < deadline, "the writer did not flush"
        time.sleep(0.05)
    assert [r["request_id"] for r in registry.recent_requests()] == ["r2", "r1", "r0"]
    records.add({"request_id": "r3"})
    records.close()  # writes what is pending
    assert registry.recent_requests()[0] == {"request_id": "r3"}


def test_request_records_keep_the_newest_when_too_many_wait(registry):
    records = RequestRecords(registry, interval_s=60, max_pending=2)
    for i in range(5):
        records.add({"request_id": f"r{i}"})
    assert records.flush() == 2
    assert [r["request_id"] for r in registry.recent_requests()] == ["r4", "r3"]
    records.close()


def test_request_records_are_dropped_not_raised_without_redis():
    records = RequestRecords(Registry(f"redis://127.0.0.1:{_free_port()}/0", timeout_s=0.2), interval_s=60)
    records.add({"request_id": "r0"})
    assert records.flush() == 0
    assert records.flush() == 0, "the failed batch is gone, not retried forever"
    records.close()


def test_shared_slo_verdicts_are_taken_once_oldest_first_and_bounded(registry):
    registry.push_verdicts([(100.5, True), (101.25, False)], keep=3, ttl_s=60)
    registry.push_verdicts([(102.0, True), (103.0, False)], keep=3, ttl_s=60)
    assert registry.take_verdicts() == [(101.25, False), (102.0, True), (103.0, False)], "the newest 3 kept"
    assert registry.take_verdicts() == [], "taken ones are gone"
    feed = VerdictFeed(registry, window_s=60, interval_s=0.05)
    try:
        before = time.monotonic()
        feed.judged(True)
        feed.flush()
        ((at, met),) = take_shared_verdicts(registry)
        assert met is True and before - 0.01 <= at <= time.monotonic() + 0.01, "at the taker's monotonic time"
    finally:
        feed.close()


def test_shared_arrivals_are_taken_once_oldest_first_and_bounded(registry):
    registry.push_arrivals([(100.5, 10, 20), (101.25, 11, 21)], keep=3, ttl_s=60)
    registry.push_arrivals([(102.0, 12, 22, 300.0, 20.0, -1), (103.0, 13, 23)], keep=3, ttl_s=60)
    assert registry.take_arrivals() == [
        (101.25, 11, 21, None, None, 0),
        (102.0, 12, 22, 300.0, 20.0, -1),
        (103.0, 13, 23, None, None, 0),
    ], "the newest 3 kept, each with its targets and priority"
    assert registry.take_arrivals() == [], "taken ones are gone"
    registry.push_arrivals([(104.0, 1, 1)], keep=3, ttl_s=0.2)
    time.sleep(0.4)
    assert registry.take_arrivals() == [], "unread ones expire after the window"


def test_a_replicas_arrival_feed_reaches_frontend_zero_at_its_own_clock(registry):
    feed = ArrivalFeed(registry, window_s=60, interval_s=0.1)
    sent_at = time.monotonic()
    feed.arrived(sent_at, 30, 64)
    feed.arrived(sent_at + 0.5, 31, 65, SLO(800.0, 25.5), priority=1)  # its own targets travel with it
    assert registry.take_arrivals() == [], "nothing is written on the caller's thread"
    deadline = time.monotonic() + 5
    taken = []
    while len(taken) < 2:
        assert time.monotonic() < deadline, "the feed did not flush"
        taken += take_shared_arrivals(registry)
        time.sleep(0.05)
    feed.close()
    assert [(p, o, slo, priority) for _, p, o, slo, priority in taken] == [
        (30, 64, None, 0),
        (31, 65, SLO(800.0, 25.5), 1),
    ]
    assert abs(taken[0][0] - sent_at) < 0.05 and abs(taken[1][0] - sent_at - 0.5) < 0.05


def test_dead_port_raises_registry_unavailable_quickly():
    registry = Registry(f"redis://127.0.0.1:{_free_port()}/0", timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(RegistryUnavailable, match="127.0.0.1"):
        registry.heartbeat(_info("p0"), LoadReport(), ttl_s=10)
    with pytest.raises(RegistryUnavailable):
        registry.instances()
    with pytest.raises(RegistryUnavailable):
        registry.recent_requests()
    assert registry.ping() is False
    assert time.monotonic() - started < 2.0
    assert RegistryUnavailable.grpc_code_name == "UNAVAILABLE"


def test_silent_server_times_out_as_registry_unavailable():
    # Accepts TCP connections (kernel backlog) but never answers: a hung Redis.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        registry = Registry(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", timeout_s=0.2)
        started = time.monotonic()
        with pytest.raises(RegistryUnavailable, match="Timeout"):
            registry.instances()
        assert time.monotonic() - started < 2.0


def test_local_redis_stop_leaves_no_process_and_is_idempotent():
    server = LocalRedis().start()
    pid, url = server.pid, server.url
    assert psutil.Process(pid).name() == "redis-server"
    with Registry(url) as registry:
        assert registry.ping()
    server.stop()
    assert _process_gone(pid)
    server.stop()  # twice is fine
    with pytest.raises(RegistryUnavailable):
        wait_for_redis(url, timeout_s=0.3)


@pytest.mark.parametrize("how", ["exception", "sigkill"])
def test_local_redis_does_not_outlive_its_owner(how):
    # The owner prints redis' pid, then dies by an uncaught exception (atexit) or SIGKILL (pdeathsig).
    script = textwrap.dedent(
        """
        import sys, time
        from disagg.cluster.redis_server import LocalRedis
        server = LocalRedis().start()
        print(server.pid, flush=True)
        if sys.argv[1] == "exception":
            raise RuntimeError("owner crashed")
        time.sleep(60)
        """
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script, how], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    work_dir = None
    try:
        redis_pid = int(owner.stdout.readline())
        if how == "sigkill":
            work_dir = psutil.Process(redis_pid).cwd()  # a SIGKILLed owner cannot remove it
            os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        assert _wait_gone(redis_pid), f"redis-server {redis_pid} outlived its owner ({how})"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if work_dir and "disagg-redis-" in work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)


def test_password_protected_redis():
    with LocalRedis(password="s3cret pw") as server:
        assert "s3cret%20pw@" in server.url
        with Registry(server.url) as registry:
            registry.heartbeat(_info("p0"), LoadReport(), ttl_s=10)
            assert [v.info.instance_id for v in registry.instances()] == ["p0"]
        wrong_url = server.url.replace("s3cret%20pw", "wrong")
        with Registry(wrong_url) as wrong:
            with pytest.raises(RegistryUnavailable) as excinfo:
                wrong.instances()
            assert "wrong" not in str(excinfo.value)  # passwords are redacted from messages
            assert wrong.ping() is False
        with Registry(f"redis://127.0.0.1:{server.port}/0") as anonymous:
            with pytest.raises(RegistryUnavailable):
                anonymous.heartbeat(_info("p1"), LoadReport(), ttl_s=10)
        with pytest.raises(RegistryUnavailable, match="password"):
            wait_for_redis(wrong_url, timeout_s=5)


def test_a_heartbeat_asked_to_beat_now_does_not_wait_for_its_interval(redis_url):
    """A drain must reach the routers within their next read, not a whole interval later."""
    instance_id = f"beat-{uuid.uuid4().hex[:8]}"
    heartbeat = Heartbeat(redis_url, 30.0, 60.0, lambda: (_info(instance_id), LoadReport(draining=True)))
    heartbeat.start(instance_id)
    with Registry(redis_url) as reader:
        try:
            time.sleep(0.3)
            assert instance_id not in {v.info.instance_id for v in reader.instances()}, "the first beat is 30 s away"
            heartbeat.beat_now()
            deadline = time.monotonic() + 2.0
            while not (seen := [v for v in reader.instances() if v.info.instance_id == instance_id]):
                assert time.monotonic() < deadline, "no beat 2 s after beat_now"
                time.sleep(0.05)
            assert seen[0].load.draining
        finally:
            heartbeat.stop(instance_id)
