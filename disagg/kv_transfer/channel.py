"""Ordered traffic with one peer: a send thread draining a bounded queue, and a receive loop
that runs only while its owner expects messages from that peer.

The loop must not idle in `recv`: with gloo a recv that times out breaks the pair, so the loop
receives only while the owner expects something from this peer, each recv waiting at most the
owner's timeout, and parks on a condition when nothing is expected. It is started on the first
transfer and kept: starting a thread per transfer would cost the engine thread that asked a
`Thread.start` (waiting for the new thread to run) every time. A single transfer's deadline is
enforced by its owner's poll(), never by timing out a recv, which would fail every transfer on
the pair. Sending happens off the caller's thread, so the model's compute never waits on the
network, only on the bounded queue (back-pressure instead of unbounded memory).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Protocol

import torch

from disagg.errors import KVTransferError
from disagg.kv_transfer.messages import Header
from disagg.kv_transfer.transport import Transport

logger = logging.getLogger(__name__)
PARKED_WAIT_S = 1.0  # a parked receive loop re-checks this often (it is woken when needed)


class ChannelOwner(Protocol):
    timeout: float  # seconds a peer may stay silent while we expect something from it

    def recv_deadline(self, peer_id: str) -> float | None:
        """time.monotonic() until which messages from the peer are expected; None: expect nothing."""

    def send_deadline(self, peer_id: str, header: Header) -> float | None:
        """By when this queued message must be sent; None: its transfer is over, skip it."""

    def payload_buffer(self, peer_id: str, header: Header) -> torch.Tensor | None:
        """Where the payload following this header goes; None when it has none."""

    def coalesce(self, messages: list[tuple[Header, torch.Tensor | None]]) -> list[tuple[Header, torch.Tensor | None]]:
        """The queued messages, in order, with those that can travel as one merged."""

    def on_message(self, peer_id: str, header: Header, payload: torch.Tensor | None) -> None: ...

    def on_error(self, peer_id: str, error: Exception) -> None:
        """The pair with the peer broke: every transfer involving it has failed."""


class PeerChannel:
    def __init__(
        self, transport: Transport, peer_id: str, peer_address: str, owner: ChannelOwner, max_queued: int = 32
    ):
        self.transport = transport
        self.peer_id = peer_id
        self.peer_address = peer_address
        self.owner = owner
        self._outbox: queue.Queue = queue.Queue(maxsize=max_queued)
        self._receiving = threading.Condition()
        self._receiver: threading.Thread | None = None
        self._closed = False
        # Protocol messages (a header and its payload count as one) each way: what a transfer
        # costs in rendezvous and thread hand-offs, whatever its bytes (loadtest.kv.transfer).
        self.messages_sent = 0
        self.messages_received = 0
        self._sender = threading.Thread(target=self._send_loop, name=f"kv-send-{peer_id}", daemon=True)
        self._sender.start()

    # ---- sending -----------------------------------------------------------------------------
    def post(self, header: Header, payload: torch.Tensor | None, timeout: float) -> None:
        """Queue a message; blocks while the queue is full, up to `timeout` seconds."""
        try:
            self._outbox.put((header, payload), timeout=timeout)
        except queue.Full:
            raise KVTransferError(f"send queue to {self.peer_id} stayed full for {timeout:.1f}s") from None

    def _send_loop(self) -> None:
        closing = False
        while not closing and (item := self._outbox.get()) is not None:
            queued = [item]
            while True:  # and whatever else is queued already
                try:
                    item = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    break
                queued.append(item)
            # A backlog goes out in fewer messages (each costs a rendezvous on both sides).
            for header, payload in self.owner.coalesce(queued):
                deadline = self.owner.send_deadline(self.peer_id, header)
                if deadline is None:
                    continue  # the transfer already ended; drop its leftovers
                try:
                    self._send(header, payload, deadline)
                except KVTransferError as exc:
                    self.owner.on_error(self.peer_id, exc)

    def _send(self, header: Header, payload: torch.Tensor | None, deadline: float) -> None:
        self._connect(deadline)
        self.transport.send(self.peer_id, header.to_tensor(), _remaining(deadline))
        if payload is not None:
            self.transport.send(self.peer_id, payload, _remaining(deadline))
        self.messages_sent += 1

    # ---- receiving ---------------------------------------------------------------------------
    def wake_receiver(self) -> None:
        """Make sure the receive loop runs (call after registering what you expect)."""
        with self._receiving:
            if self._receiver is None and not self._closed:
                self._receiver = threading.Thread(target=self._recv_loop, name=f"kv-recv-{self.peer_id}", daemon=True)
                self._receiver.start()
            self._receiving.notify()

    def _recv_loop(self) -> None:
        try:
            while not self._closed:
                deadline = self.owner.recv_deadline(self.peer_id)
                if deadline is None:
                    self._park()
                    continue
                # Each recv may wait a full timeout, whatever a transfer has left: a pair breaks only
                # when the peer stays silent that long while we expect it (transfers expire on their own).
                deadline = max(deadline, time.monotonic() + self.owner.timeout)
                try:
                    self._receive_one(deadline)
                except KVTransferError as exc:
                    self.owner.on_error(self.peer_id, exc)
        finally:
            with self._receiving:  # a later wake_receiver starts a fresh loop, should this one die
                self._receiver = None

    def _park(self) -> None:
        """Wait until something is expected again; re-checked under the lock, so a wake_receiver
        between the owner's answer and the wait is not lost."""
        with self._receiving:
            if not self._closed and self.owner.recv_deadline(self.peer_id) is None:
                self._receiving.wait(PARKED_WAIT_S)

    def _receive_one(self, deadline: float) -> None:
        self._connect(deadline)
        raw = Header.empty()
        self.transport.recv(self.peer_id, raw, _remaining(deadline))
        header = Header.from_tensor(raw)
        payload = self.owner.payload_buffer(self.peer_id, header)
        if payload is not None:
            self.transport.recv(self.peer_id, payload, _remaining(deadline))
        self.messages_received += 1
        self.owner.on_message(self.peer_id, header, payload)

    def _connect(self, deadline: float) -> None:
        # Every time (free on a live pair): the transport rebuilds a pair it found broken.
        self.transport.connect(self.peer_id, self.peer_address, _remaining(deadline))

    def close(self) -> None:
        with self._receiving:
            self._closed = True
            self._receiving.notify()
        try:
            self._outbox.put_nowait(None)
        except queue.Full:
            pass  # the send thread is a daemon; it ends with the process


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise KVTransferError("deadline passed")
    return remaining
