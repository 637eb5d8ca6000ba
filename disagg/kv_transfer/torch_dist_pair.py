"""One live pair of TorchDistTransport: its process groups, and waits that end when the pair breaks.

gloo does not wake an operation already under way when its connection drops (it wakes only those
still waiting for the peer: it signals its pending lists, not the message being written or read),
so a send or recv to a peer that dies mid-message would wait out its whole timeout. So:

- the pair keeps a recv posted on a tag nobody sends to, watched by a thread: gloo fails it as
  soon as the connection drops, and that marks the pair broken;
- a caller never blocks in gloo itself: a worker thread of the pair waits on the operation, and
  the caller waits for whichever comes first, the operation or the breakage. An operation gloo
  does not wake keeps its worker until its deadline; the pair is discarded by then anyway.
- closing the pair closes its connection at once (a 1 ms wait on a recv that cannot match: gloo
  closes the connection on any timeout), so the peer's pending operations fail at once too.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from disagg.auth import Seals
from disagg.kv_transfer.paths import KVPath
from disagg.kv_transfer.rendezvous import PairStore

# How long past its deadline a caller waits for gloo to report the timeout of its operation.
_TIMEOUT_GRACE_S = 1.0
# After the pair breaks, how long a caller waits for its operation to report its own, clearer error.
_OWN_ERROR_GRACE_S = 0.05
# The sentinel recv must outlive any pair (its timeout would close the pair).
_SENTINEL_TIMEOUT = timedelta(days=7)
SENTINEL_TAG, CLOSE_TAG = 100, 101


@dataclass
class Pair:
    """A 2-rank gloo group (and NCCL groups, made on first use) with one peer."""

    peer_id: str
    peer_address: str
    rank: int
    generation: int
    generation_key: str
    prefix: str
    store: PairStore  # the pair's table: in our rendezvous, or over a connection to the peer's
    timeout: timedelta
    gloo: dist.ProcessGroupGloo
    inbox: torch.Tensor  # the first message of each recv lands here (gloo); under recv_lock
    same_host: bool = False  # the peer can map our shared tensors (shared_memory.host_key)
    # How KV goes to the peer and comes from it (kv_transfer.paths), chosen when the pair is made.
    path_out: KVPath = KVPath.GLOO
    path_in: KVPath = KVPath.GLOO
    # Tags on every gloo message, each direction in order (disagg.auth): pairs across hosts; None: none.
    seals: Seals | None = None
    nccl: dict[int, dist.ProcessGroupNCCL] = field(default_factory=dict)  # sender rank -> group
    broken: futures.Future = field(default_factory=futures.Future)  # its result: why it broke
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    recv_lock: threading.Lock = field(default_factory=threading.Lock)
    nccl_lock: threading.Lock = field(default_factory=threading.Lock)
    # One operation per direction is under way at a time (the two locks above).
    waiters: futures.ThreadPoolExecutor = field(
        default_factory=lambda: futures.ThreadPoolExecutor(2, thread_name_prefix="kv-wait")
    )
    watcher: threading.Thread | None = None

    @property
    def peer_rank(self) -> int:
        return 1 - self.rank

    def watch(self) -> None:
        """Mark the pair broken as soon as its connection drops."""
        sentinel = self.gloo.recv([torch.empty(1)], self.peer_rank, SENTINEL_TAG)
        self.watcher = threading.Thread(
            target=self._watch, args=(sentinel,), name=f"kv-watch-{self.peer_id}", daemon=True
        )
        self.watcher.start()

    def _watch(self, sentinel) -> None:
        try:
            sentinel.wait(_SENTINEL_TIMEOUT)
            reason = "unexpected message on the sentinel tag"
        except RuntimeError as exc:
            reason = first_line(exc)
        self.mark_broken(reason)

    def wait(self, work, deadline: float) -> None:
        """Wait for one operation; raise RuntimeError when it fails, times out or the pair breaks."""
        waiting = self.waiters.submit(_wait_work, work, deadline)
        try:
            futures.wait([waiting, self.broken], remaining(deadline) + _TIMEOUT_GRACE_S, futures.FIRST_COMPLETED)
            if not waiting.done() and self.broken.done():
                futures.wait([waiting], _OWN_ERROR_GRACE_S)
            if waiting.done():
                waiting.result()  # raises its error
                return
        finally:
            waiting = None  # the error's traceback holds this frame: no reference cycle through it
        if self.broken.done() and time.monotonic() < deadline:
            raise RuntimeError(f"connection lost: {self.broken.result()}")
        raise TimeoutError("timed out")

    def mark_broken(self, reason: str) -> None:
        try:
            self.broken.set_result(reason)
        except futures.InvalidStateError:
            pass  # broken already; the first reason stays

    def close(self) -> None:
        """Close the connection now, so that the peer's pending operations on it fail at once."""
        self.mark_broken("discarded on this side")
        try:
            self.gloo.recv([torch.empty(1)], self.peer_rank, CLOSE_TAG).wait(timedelta(milliseconds=1))
        except RuntimeError:
            pass  # the timeout that closes it, or it was closed already
        for group in self.nccl.values():
            try:
                group.abort()  # ends NCCL operations stuck on a dead peer
            except RuntimeError:
                pass
        self.waiters.shutdown(wait=False)
        self.store.close()


def _wait_work(work, deadline: float) -> None:
    if not work.wait(timedelta(seconds=remaining(deadline))):
        raise TimeoutError("timed out")


def remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def first_line(exc: BaseException) -> str:
    """The message of a c10d or gloo error without its C++ stack trace and source location."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else ""
    if first.startswith("[") and "] " in first:
        first = first.split("] ", 1)[1]
    return f"{type(exc).__name__}: {first}"
