"""From the config's `kv_transport` name to the transport a worker sends and receives KV over: the
one place that names an implementation, so workers, shards and the transfer benchmarks build
the same thing from the same setting.

The in-process transport (disagg.kv_transfer.inproc) is not here: it needs a hub shared by both
sides, which only tests that run both in one process have.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from disagg.engine.engine import resolve_device
from disagg.kv_transfer.torch_dist import TorchDistTransport
from disagg.kv_transfer.transport import Transport


def _torch_dist(worker_id: str, key: bytes, host: str, device: torch.device) -> Transport:
    return TorchDistTransport(worker_id, key, host, device=device)


# (worker_id, deployment key, host to listen on, KV cache device) -> transport. Keyed by
# `disagg.config.KV_TRANSPORTS`. torch_dist chooses each pair's path from both sides' devices
# (kv_transfer.paths: shared memory or CUDA IPC on one host, NCCL between GPUs, gloo otherwise).
KV_TRANSPORT_CLASSES: dict[str, Callable[[str, bytes, str, torch.device], Transport]] = {
    "torch_dist": _torch_dist,
}


def make_transport(
    name: str, worker_id: str, key: bytes, host: str = "127.0.0.1", device: str | torch.device = "cpu"
) -> Transport:
    """The transport `name` (a config's `kv_transport`) for `worker_id`, listening on `host`;
    `key`: the deployment's (disagg.auth), which a peer must hold to connect; `device`: where the
    worker's KV cache is (EngineConfig.device: "auto" is CUDA where there is one)."""
    build = KV_TRANSPORT_CLASSES.get(name)
    if build is None:
        known = ", ".join(KV_TRANSPORT_CLASSES)
        raise ValueError(f"kv_transport: unknown transport {name!r} (known: {known})")
    return build(worker_id, key, host, resolve_device(str(device)))
