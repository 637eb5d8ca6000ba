"""Where workers listen and whether Redis is reachable, decided from the cluster's node count."""

from __future__ import annotations

import pytest

from disagg.hosts.addressing import LOOPBACK, check_redis_reachable, is_loopback, worker_host


def test_one_node_stays_on_loopback_several_use_each_node_ip():
    assert worker_host(None, 1) == LOOPBACK
    assert worker_host(None, 3) is None  # each worker resolves its own node's IP
    assert worker_host("10.0.0.7", 3) == "10.0.0.7"
    assert worker_host("10.0.0.7", 1) == "10.0.0.7"


@pytest.mark.parametrize(
    "host,loopback",
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("10.0.0.1", False),
        ("redis.internal", False),
    ],
)
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_loopback_redis_is_refused_on_several_nodes_without_leaking_its_password():
    check_redis_reachable("redis://127.0.0.1:6380/0", 1)
    check_redis_reachable("redis://10.0.0.1:6380/0", 2)
    with pytest.raises(ValueError, match="redis_url") as err:
        check_redis_reachable("redis://:hunter2@localhost:6380/0", 2)
    assert "hunter2" not in str(err.value)
