"""From the config's `kv_transport` name to the transport a worker sends and receives KV over: the
one place that names an implementation, so workers, shards and the transfer benchmarks build
the same thing from the same setting; and, from a rank's role, which transports it has
(`role_transports`).

The in-process transport (disagg.kv_transfer.inproc) is not here: it needs a hub shared by both
sides, which only tests that run both in one process have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagg.config import Role
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


@dataclass
class RoleTransports:
    """What a rank of a role moves KV over: `kv` (None: COLOCATED, which moves none); on a
    one-rank DECODE instance, `moves`, which requests moving out go over; on a one-rank PREFILL
    or DECODE instance, `exports`, which its cached blocks are lent to peers over, and on a
    one-rank PREFILL instance `imports`, which it fetches peers' blocks over
    (disagg.kv_transfer.peer_blocks)."""

    kv: Transport | None = None
    moves: Transport | None = None
    exports: Transport | None = None
    imports: Transport | None = None

    def close(self) -> None:
        for transport in (self.kv, self.moves, self.exports, self.imports):
            if transport is not None:
                transport.close()


def role_transports(
    name: str, role: Role, transport_id: str, key: bytes, host: str, device: str, *, one_rank: bool
) -> RoleTransports:
    """The transports of a rank in `role`, made by `name` (a config's `kv_transport`): its KV's,
    named `transport_id` (a KV peer id), except for COLOCATED; on an instance of `one_rank`, for
    DECODE one for moving requests out (`<transport_id>-move`), for PREFILL and DECODE one that
    lends cached blocks (`<transport_id>-export`), and for PREFILL one that fetches them
    (`<transport_id>-import`). The one place that says which role moves what (rank 0 at its start
    and at a role switch, and the other ranks)."""
    if role is Role.COLOCATED:
        return RoleTransports()
    made = RoleTransports(make_transport(name, transport_id, key, host, device))
    if not one_rank:
        return made
    extra = (
        {"exports": "export", "moves": "move"} if role is Role.DECODE else {"exports": "export", "imports": "import"}
    )
    try:
        for field_name, suffix in extra.items():
            setattr(made, field_name, make_transport(name, f"{transport_id}-{suffix}", key, host, device))
    except BaseException:
        made.close()
        raise
    return made
