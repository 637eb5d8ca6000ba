"""What a sender and a receiver share: channels to peers, one lock, and finished transfers.

A transfer is a polled state machine (pending -> transferring -> done | failed). The
engine's thread calls `poll()` between steps to learn which finished; channel threads move
transfers forward under the lock.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

from disagg.engine.kv_cache import KVCache
from disagg.engine.kv_connector import KVConnector, TransferResult  # noqa: F401 (TransferResult: re-exported)
from disagg.kv_transfer.channel import PeerChannel
from disagg.kv_transfer.transport import Transport


class TransferState(enum.Enum):
    PENDING = "pending"  # registered, nothing moved yet
    TRANSFERRING = "transferring"
    AWAITING_ACK = "awaiting_ack"  # sender: everything sent, DONE posted
    DONE = "done"
    FAILED = "failed"


class KVEndpoint(KVConnector):
    def __init__(
        self, transport: Transport, timeout: float, max_queued_messages: int, wake: Callable[[], None] | None = None
    ):
        """`wake`: called (from a channel thread, lock held) when a transfer finishes, so that the
        loop of the worker that polls this endpoint runs its next poll now rather than idle."""
        self.kv_cache: KVCache | None = None  # this rank's, once the engine registers it
        self.transport = transport
        self.timeout = timeout
        self.max_queued_messages = max_queued_messages
        self._lock = threading.Lock()
        self._channels: dict[str, PeerChannel] = {}
        self._channels_lock = threading.Lock()  # channels are looked up from several threads
        self._finished: list[TransferResult] = []
        self.num_bytes_total = 0  # KV payload bytes sent or received (a Prometheus counter's source)
        self._wake = wake

    def register_kv_cache(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache

    @property
    def worker_id(self) -> str:
        return self.transport.worker_id

    def address(self) -> str:
        return self.transport.address()

    def _channel(self, peer_id: str, peer_address: str) -> PeerChannel:
        with self._channels_lock:
            channel = self._channels.get(peer_id)
            if channel is None or channel.peer_address != peer_address:
                if channel is not None:  # the peer restarted at a new address
                    channel.close()
                channel = self._channels[peer_id] = PeerChannel(
                    self.transport, peer_id, peer_address, self, self.max_queued_messages
                )
            return channel

    @property
    def num_messages_total(self) -> int:
        """Protocol messages this endpoint sent and received, over every peer so far."""
        with self._channels_lock:
            channels = list(self._channels.values())
        return sum(c.messages_sent + c.messages_received for c in channels)

    def coalesce(self, messages: list) -> list:
        return messages  # see KVSender.coalesce

    def has_finished(self) -> bool:
        """A lock-free peek, for a loop deciding whether to step: a transfer ended, or one is past
        its deadline (an idle engine would otherwise never poll, and never free its blocks)."""
        return bool(self._finished) or self._overdue(time.monotonic())

    def _overdue(self, now: float) -> bool:
        return False

    def _report(self, result: TransferResult) -> None:
        self._finished.append(result)
        if self._wake is not None:
            self._wake()

    def poll(self) -> list[TransferResult]:
        """Transfers that finished (either way) since the last poll; also enforces deadlines."""
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            finished, self._finished = self._finished, []
        return finished

    def _expire(self, now: float) -> None:
        """Fail transfers whose deadline passed (caller holds the lock)."""
        raise NotImplementedError

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self.transport.close()
