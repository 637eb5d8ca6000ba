"""One local Ray instance for every integration test of the session (starting Ray costs seconds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Ray workers import actor classes by module name; test modules here are top-level modules
# (pytest puts this directory on sys.path), so the workers need it on theirs too.
_TEST_DIR = str(Path(__file__).resolve().parent)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with 2 CPUs that can import actor classes defined in these test modules.

    Actors should call torch.set_num_threads(1).
    """
    import ray

    if ray.is_initialized():  # started by someone else in this process: use it, leave it running
        yield ray
        return
    python_path = os.pathsep.join(p for p in (_TEST_DIR, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        address="local",  # our own, even where a `ray start` cluster runs on this machine
        num_cpus=2,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": {"PYTHONPATH": python_path}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def local_redis():
    """One real redis-server (no persistence, free port) for the session; stopped at the end."""
    from disagg.cluster.redis_server import LocalRedis

    with LocalRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(local_redis) -> str:
    return local_redis.url
