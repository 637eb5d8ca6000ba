"""A deployment whose workers cannot fit their KV cache in their device's memory does not start:
the server raises the worker's own refusal, with the figures (disagg.engine.memory_fit), before
any worker allocated it, and leaves nothing behind."""

from __future__ import annotations

import pytest
from ray.util import placement_group_table

from disagg.config import ServingConfig
from disagg.engine.device_memory import host_available_bytes
from disagg.errors import ModelLoadError
from disagg.server import Server


def test_a_kv_cache_larger_than_the_hosts_memory_is_refused_with_the_figures(ray_session):
    too_much = int(host_available_bytes() * 2)
    config = ServingConfig.from_dict(
        {
            "mode": "colocated",
            "engine": {"model": "random:tiny", "kv_cache_memory_bytes": too_much},
            "colocated": {"num_cpus_per_worker": 0.5},
            "port": 0,
            "http_port": 0,
        }
    )
    with pytest.raises(ModelLoadError) as refused:
        Server(config).start()
    message = str(refused.value)
    assert "colocated worker" in message and "of KV cache" in message and "this host's available memory" in message
    assert "kv_cache_memory_bytes to at most" in message and "actor died" not in message, message
    assert all(group["state"] == "REMOVED" for group in placement_group_table().values())
