"""Where the ranks of a TP x PP instance meet to build their process groups: a store that only
they can use.

A TCPStore answers anyone who reaches its port, and lists its keys to them: a stranger could read
the groups' addresses, or write its own and join a group as a rank. So rank 0 serves the world
on a kv_transfer.rendezvous store instead: a caller proves it holds the deployment key
(disagg.auth's handshake, bound to the world's name) before any key is read or written. The
name carries rank 0's instance id and address; rank 0 hands it to the other ranks over Ray (a
call inside the cluster), with the key they already hold.

What this does not cover: the gloo and NCCL connections the groups then open between the ranks
carry tensors with no authentication of their own (as in any torch.distributed job). On one node
they listen on the loopback address (`worker_host`); across nodes, on the nodes' addresses,
which must be a private network (docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.config import DEFAULT_GROUP_TIMEOUT_S
from disagg.kv_transfer.rendezvous import PairStore, Rendezvous, connect_pair_store


@dataclass(frozen=True)
class WorldAddress:
    """How a rank reaches the world's store."""

    host: str
    port: int
    name: str  # what the store serves under: "<instance id>@<host:port>/world"


class InstanceWorld:
    """Rank 0's side: the store, served until `close`."""

    def __init__(self, instance_id: str, key: bytes, host: str, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S):
        """`timeout_s`: how long the ranks may take to join (ServingConfig.group_timeout_s)."""
        self.timeout_s = timeout_s
        self._rendezvous = Rendezvous(instance_id, key, host)
        port = self._rendezvous.port
        self._rendezvous.own_address = f"{host}:{port}"
        self.address = WorldAddress(host, port, f"{instance_id}@{host}:{port}/world")

    def store(self) -> PairStore:
        """Rank 0's own store of the world, in process."""
        return self._rendezvous.pair_store(self.address.name, self.timeout_s)

    def close(self) -> None:
        self._rendezvous.close()


def connect_world(address: WorldAddress, key: bytes, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> PairStore:
    """Another rank's store of the world: one authenticated connection to rank 0's. OSError if
    unreachable, AuthenticationError if rank 0 does not hold `key`."""
    return connect_pair_store(address.host, address.port, address.name, key, timeout_s)
