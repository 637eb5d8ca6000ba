"""From the config's `kv_transport` name to the transport a worker sends and receives KV over: the
one place that names an implementation, so workers, shards and the transfer benchmarks build
the same thing from the same setting.

The in-process transport (disagg.kv_transfer.inproc) is not here: it needs a hub shared by both
sides, which only tests that run both in one process have.
"""

from __future__ import annotations

from collections.abc import Callable

from disagg.kv_transfer.torch_dist import TorchDistTransport
from disagg.kv_transfer.transport import Transport

# (worker_id, deployment key, host to listen on) -> transport. Keyed by `disagg.config.KV_TRANSPORTS`.
# torch_dist picks its backend from each tensor's device (gloo on CPU, NCCL on CUDA).
KV_TRANSPORT_CLASSES: dict[str, Callable[[str, bytes, str], Transport]] = {
    "torch_dist": TorchDistTransport,
}


def make_transport(name: str, worker_id: str, key: bytes, host: str = "127.0.0.1") -> Transport:
    """The transport `name` (a config's `kv_transport`) for `worker_id`, listening on `host`;
    `key`: the deployment's (disagg.auth), which a peer must hold to connect."""
    build = KV_TRANSPORT_CLASSES.get(name)
    if build is None:
        known = ", ".join(KV_TRANSPORT_CLASSES)
        raise ValueError(f"kv_transport: unknown transport {name!r} (known: {known})")
    return build(worker_id, key, host)
