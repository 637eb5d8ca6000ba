"""An in-process transport for unit tests of the protocol: peers are threads sharing one hub.

It keeps the semantics of the torch.distributed transport that a protocol can observe:

- `send` is a rendezvous by default (`max_queue=0`): it returns once the receiver has taken the
  message, as gloo and NCCL do; so a worker that sends to and receives from one peer must do so
  from two threads, here as there. `max_queue > 0` buffers that many messages per direction.
- any failure (timeout, dead peer, mismatched message, `disconnect`) resets the pair for both
  sides: the other side's next operation fails too, and both call `connect` again.
- `hub.kill(worker_id)` makes every operation with that worker fail at once.

`connect` waits only until the peer exists (its transport was made); it does not wait for the
peer to call `connect` too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from disagg.errors import KVTransferError
from disagg.kv_transfer.paths import KVPath
from disagg.kv_transfer.transport import Transport


@dataclass
class _Message:
    tensor: torch.Tensor
    taken: bool = False


class InProcessHub:
    """The shared state of in-process peers: who exists, who is dead, channels, pair generations."""

    def __init__(self, max_queue: int = 0):
        if max_queue < 0:
            raise ValueError(f"max_queue: must be >= 0, got {max_queue}")
        self.max_queue = max_queue
        self._cond = threading.Condition()
        self._alive: set[str] = set()
        self._dead: set[str] = set()
        self._channels: dict[tuple[str, str], deque[_Message]] = {}  # (src, dst) -> messages
        self._generations: dict[tuple[str, str], int] = {}  # sorted pair -> generation

    def kill(self, worker_id: str) -> None:
        """The worker is gone: its pairs are reset, and operations with it fail at once."""
        with self._cond:
            self._alive.discard(worker_id)
            self._dead.add(worker_id)
            for pair in [p for p in self._generations if worker_id in p]:
                self._reset_locked(pair)
            self._cond.notify_all()

    # ---- used by InProcessTransport -------------------------------------------------------------
    def register(self, worker_id: str) -> None:
        with self._cond:
            if worker_id in self._alive:
                raise ValueError(f"worker_id: {worker_id!r} is already registered with this hub")
            self._dead.discard(worker_id)
            self._alive.add(worker_id)
            self._cond.notify_all()

    def join(self, worker_id: str, peer_id: str, timeout: float) -> int:
        """Wait until the peer exists; the pair's current generation."""
        with self._cond:
            self._cond.wait_for(lambda: peer_id in self._alive or self._gone(worker_id, peer_id), timeout)
            self._raise_if_gone(worker_id, peer_id)
            if peer_id not in self._alive:
                raise KVTransferError(f"kv transfer {worker_id} <-> {peer_id}: peer did not join within {timeout:.1f}s")
            return self._generations.setdefault(_pair(worker_id, peer_id), 0)

    def reset(self, worker_id: str, peer_id: str, generation: int) -> None:
        """Retire the pair's `generation` (a no-op when it is already retired)."""
        with self._cond:
            if self._generations.get(_pair(worker_id, peer_id)) == generation:
                self._reset_locked(_pair(worker_id, peer_id))
                self._cond.notify_all()

    def put(self, src: str, dst: str, generation: int, tensor: torch.Tensor, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        message = _Message(tensor)
        with self._cond:
            channel = self._channels.setdefault((src, dst), deque())
            self._wait(src, dst, generation, lambda: len(channel) < max(self.max_queue, 1), deadline, "send")
            channel.append(message)
            self._cond.notify_all()
            if self.max_queue == 0:
                self._wait(src, dst, generation, lambda: message.taken, deadline, "send")

    def get(self, dst: str, src: str, generation: int, out: torch.Tensor, timeout: float) -> torch.Tensor:
        deadline = time.monotonic() + timeout
        with self._cond:
            channel = self._channels.setdefault((src, dst), deque())
            self._wait(dst, src, generation, lambda: len(channel) > 0, deadline, "recv")
            message = channel[0]
            if message.tensor.shape != out.shape or message.tensor.dtype != out.dtype:
                self._reset_locked(_pair(src, dst))
                self._cond.notify_all()
                raise KVTransferError(
                    f"kv transfer {dst} <-> {src}: message mismatch: expected {_describe(out)}, got {_describe(message.tensor)}"
                )
            channel.popleft()
            message.taken = True
            self._cond.notify_all()
            return message.tensor

    # ---- internals (called with the condition held) --------------------------------------------
    def _wait(self, me: str, peer: str, generation: int, ready, deadline: float, op: str) -> None:
        """Wait for `ready()`; raise KVTransferError, resetting the pair, on death, reset or timeout."""
        pair = _pair(me, peer)
        broken = lambda: self._gone(me, peer) or self._generations.get(pair) != generation
        self._cond.wait_for(lambda: broken() or ready(), max(deadline - time.monotonic(), 0.0))
        if broken():
            self._raise_if_gone(me, peer)
            raise KVTransferError(f"kv transfer {me} <-> {peer}: {op} failed: the pair was reset (reconnect)")
        if not ready():
            self._reset_locked(pair)
            self._cond.notify_all()
            raise KVTransferError(f"kv transfer {me} <-> {peer}: {op} timed out")

    def _gone(self, worker_id: str, peer_id: str) -> bool:
        return worker_id in self._dead or peer_id in self._dead

    def _raise_if_gone(self, worker_id: str, peer_id: str) -> None:
        if worker_id in self._dead:
            raise KVTransferError(f"kv transfer {worker_id} <-> {peer_id}: this worker was killed or closed")
        if peer_id in self._dead:
            raise KVTransferError(f"kv transfer {worker_id} <-> {peer_id}: peer is dead")

    def _reset_locked(self, pair: tuple[str, str]) -> None:
        self._generations[pair] = self._generations.get(pair, 0) + 1
        a, b = pair
        for key in ((a, b), (b, a)):
            if key in self._channels:
                self._channels[key] = deque()  # waiters hold the old deque; the generation wakes them


class InProcessTransport(Transport):
    def __init__(self, worker_id: str, hub: InProcessHub):
        self.worker_id = worker_id
        self._hub = hub
        self._generations: dict[str, int] = {}  # peer -> generation of our pair with it
        self._lock = threading.Lock()
        hub.register(worker_id)

    def address(self) -> str:
        return f"inproc://{self.worker_id}"

    def connect(self, peer_id: str, peer_address: str, timeout: float) -> None:
        if peer_id == self.worker_id:
            raise ValueError(f"peer_id: a worker cannot connect to itself ({peer_id!r})")
        generation = self._hub.join(self.worker_id, peer_id, timeout)
        with self._lock:
            self._generations[peer_id] = generation

    def send(self, peer_id: str, tensor: torch.Tensor, timeout: float) -> None:
        generation = self._generation(peer_id)
        with self._failing_pair(peer_id, generation):
            self._hub.put(self.worker_id, peer_id, generation, tensor.detach().clone(), timeout)

    def recv(self, peer_id: str, out: torch.Tensor, timeout: float) -> None:
        generation = self._generation(peer_id)
        with self._failing_pair(peer_id, generation):
            out.copy_(self._hub.get(self.worker_id, peer_id, generation, out, timeout))

    def path_to(self, peer_id: str) -> KVPath | None:
        return KVPath.SHARED_MEMORY  # one process: every peer's cache is mappable, connected or not

    def disconnect(self, peer_id: str) -> None:
        with self._lock:
            generation = self._generations.pop(peer_id, None)
        if generation is not None:
            self._hub.reset(self.worker_id, peer_id, generation)

    def close(self) -> None:
        with self._lock:
            self._generations.clear()
        self._hub.kill(self.worker_id)

    def _generation(self, peer_id: str) -> int:
        with self._lock:
            generation = self._generations.get(peer_id)
        if generation is None:
            raise KVTransferError(
                f"kv transfer {self.worker_id} <-> {peer_id}: not connected (connect first, and again after a failure)"
            )
        return generation

    @contextmanager
    def _failing_pair(self, peer_id: str, generation: int):
        """After a failed operation this side holds no pair, as after a failure of the real transport."""
        try:
            yield
        except KVTransferError:
            with self._lock:
                if self._generations.get(peer_id) == generation:
                    del self._generations[peer_id]
            raise


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
