"""What a `ray up` cluster asks of disagg: each machine's node labels (disagg.cluster.node_labels),
a config pinned to them (--cluster), and a server that stops when its cluster goes."""

from __future__ import annotations

import pytest

from disagg.cluster.node_labels import main, pool_resources, ray_start_flags, reached_address
from disagg.config import POOL_LABEL_SLIVER, ServingConfig

POOLS = {"prefill": ["10.0.0.2"], "decode": ["10.0.0.3", "10.0.0.4"], "colocated": []}


def test_a_machine_is_the_address_ssh_reached_it_at():
    assert reached_address("10.0.0.9 51234 10.0.0.3 22") == "10.0.0.3"
    with pytest.raises(ValueError, match="SSH_CONNECTION"):
        reached_address(None)


def test_each_listed_machine_is_labelled_for_its_pool_and_the_rest_for_none():
    assert pool_resources("10.0.0.2", POOLS) == {"prefill": 1}
    assert pool_resources("10.0.0.4", POOLS) == {"decode": 1}
    assert pool_resources("10.0.0.1", POOLS) == {}  # the head
    with pytest.raises(ValueError, match="several pools"):
        pool_resources("10.0.0.2", {"prefill": ["10.0.0.2"], "decode": ["10.0.0.2"]})


def test_the_flags_survive_an_unquoted_shell_substitution():
    flags = ray_start_flags("10.0.0.3", POOLS)
    assert flags == '--node-ip-address=10.0.0.3 --resources={"decode":1}'
    assert len(flags.split()) == 2  # no space inside the JSON


def test_the_command_line_prints_the_flags_or_says_what_is_missing(capsys, monkeypatch):
    monkeypatch.setenv("SSH_CONNECTION", "10.0.0.9 51234 10.0.0.2 22")
    assert main(["--prefill", "10.0.0.2", "--decode", "10.0.0.3"]) == 0
    assert capsys.readouterr().out.strip() == '--node-ip-address=10.0.0.2 --resources={"prefill":1}'
    monkeypatch.delenv("SSH_CONNECTION")
    assert main(["--decode", "10.0.0.3"]) == 2
    assert "SSH_CONNECTION" in capsys.readouterr().err


def test_on_a_cluster_each_pool_is_pinned_to_its_label_and_ray_is_joined():
    config = ServingConfig.from_dict({"prefill": {"resources": {"fast": 1}}}).on_cluster()
    assert config.ray_address == "auto"
    assert config.prefill.resources == {"prefill": POOL_LABEL_SLIVER, "fast": 1}
    assert config.decode.resources == {"decode": POOL_LABEL_SLIVER}
    colocated = ServingConfig.from_dict({"mode": "colocated", "ray_address": "10.0.0.1:6379"}).on_cluster()
    assert colocated.ray_address == "10.0.0.1:6379"
    assert colocated.colocated.resources == {"colocated": POOL_LABEL_SLIVER}


def test_a_server_sees_its_cluster_gone_after_three_refused_connections():
    import socket

    from disagg.server import ClusterWatch

    listener = socket.create_server(("127.0.0.1", 0))
    watch = ClusterWatch(listener.getsockname())
    assert not watch.gone()
    listener.close()
    assert [watch.gone() for _ in range(ClusterWatch.MISSES)] == [False] * (ClusterWatch.MISSES - 1) + [True]


def test_a_gcs_restarting_alone_is_not_its_cluster_gone_while_the_raylet_answers():
    """Its tables in Redis, the head's GCS may restart (deploy/head-redis.sh): `ray down` ends the
    raylet too, a GCS restart does not."""
    import socket

    from disagg.server import ClusterWatch

    gcs, raylet = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    watch = ClusterWatch(gcs.getsockname(), raylet.getsockname())
    gcs.close()
    assert [watch.gone() for _ in range(ClusterWatch.MISSES + 2)] == [False] * (ClusterWatch.MISSES + 2)
    raylet.close()
    assert [watch.gone() for _ in range(ClusterWatch.MISSES)] == [False] * (ClusterWatch.MISSES - 1) + [True]


def test_serve_takes_the_redis_url_from_the_environment_where_the_config_names_none(monkeypatch):
    from disagg.server import serving_config

    monkeypatch.setenv("DISAGG_REDIS_URL", "redis://:pw@10.0.0.1:6380/0")
    assert serving_config(None, {}).redis_url == "redis://:pw@10.0.0.1:6380/0"
    assert serving_config(None, {"redis_url": "redis://10.0.0.9:6379/0"}).redis_url == "redis://10.0.0.9:6379/0"
