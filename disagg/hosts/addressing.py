"""Which address the workers listen on and advertise, and where they find Redis.

A worker's request link, KV transport and rank rendezvous listen on one host address, which the
registry advertises to routers and peers. On one machine that is loopback: nothing outside the
machine can reach the workers. On a cluster of several nodes the frontend and the peers are
elsewhere, so each worker takes its own node's IP (Ray knows it), unless the config names one.
Redis must then be reachable from every node too: a loopback URL is a configuration error.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from disagg.errors import InvalidRequestError

LOOPBACK = "127.0.0.1"
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")  # listen on every interface


def worker_host(configured: str | None, num_nodes: int) -> str | None:
    """The host workers bind; None: each worker's own node IP, resolved on its node."""
    if configured is not None:
        return configured
    return LOOPBACK if num_nodes <= 1 else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_redis_reachable(redis_url: str, num_nodes: int) -> None:
    """Workers on other nodes heartbeat to `redis_url`: it must not be this machine's loopback."""
    host = urlsplit(redis_url).hostname or ""
    if num_nodes > 1 and is_loopback(host):
        raise InvalidRequestError(
            "redis_url",
            f"{host} is reachable from this machine only, and the Ray cluster has {num_nodes} nodes; "
            "give the address of the machine that runs Redis (or leave redis_url unset: disagg serve then starts one on this node's IP)",
        )


def num_alive_nodes() -> int:
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive"))


def resolve_host(host: str | None) -> str:
    """A worker's bind address: `host`, or (None) this process's node IP as Ray sees it, the
    address its peers on other nodes reach."""
    if host is not None:
        return host
    import ray.util

    return ray.util.get_node_ip_address()
