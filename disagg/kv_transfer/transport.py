"""The transport interface: ordered point-to-point tensor messages between named workers.

A pair of workers is connected by both sides calling `connect` (a rendezvous). After any failure
(timeout, dead peer, broken connection, mismatched message) the pair is discarded on the side that
saw it, which closes its connection: the other side's pair breaks too, within a moment, and its next
operation on it fails. Both sides then call `connect` again, which builds a fresh pair (a `connect`
on a pair that has not broken yet keeps it). Completion of `send` means the data left this worker, not that the peer
used it: a protocol that must know acknowledges explicitly.

`send` is a rendezvous: it may block until the peer posts the matching `recv` (gloo and NCCL both
work this way). So a worker that sends to and receives from one peer does so from two threads;
one thread may send to a peer while another receives from it. Two threads sending to the same
peer are serialised (each message stays whole), and so are two receivers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from disagg.kv_transfer.paths import KVPath


class Transport(ABC):
    """Ordered point-to-point tensor messages between this worker and named peers."""

    worker_id: str

    @abstractmethod
    def address(self) -> str:
        """What a peer needs to reach us, as a plain string (it travels through Ray or Redis)."""

    @abstractmethod
    def connect(self, peer_id: str, peer_address: str, timeout: float) -> None:
        """Make the pair with `peer_id` usable; both sides call it. Idempotent while the pair is healthy.

        Raises KVTransferError when the peer does not join within `timeout` seconds.
        """

    @abstractmethod
    def send(self, peer_id: str, tensor: torch.Tensor, timeout: float) -> None:
        """Send one message; blocks until the peer has taken it in. Messages to one peer arrive in order."""

    @abstractmethod
    def recv(self, peer_id: str, out: torch.Tensor, timeout: float) -> None:
        """Receive the next message from `peer_id` into `out`, whose shape and dtype must match it."""

    def path_to(self, peer_id: str) -> KVPath | None:
        """How KV goes to the peer (kv_transfer.paths); None until the pair is connected."""
        return None

    def paths(self) -> dict[str, str]:
        """Peer id -> how KV goes to it, for every connected pair (what `disagg status` shows)."""
        return {}

    @abstractmethod
    def disconnect(self, peer_id: str) -> None:
        """Drop the pair (after an error, or when the peer left); the peer's next use of it fails."""

    def close(self) -> None:
        """Drop every pair and stop being reachable."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
