"""Waiting for a peer process on the same host: spin briefly, then block until woken, never longer
than the caller's timeout, and fail at once when the peer has exited.

A step of a TP x PP instance is a round trip between rank 0 and its followers: the gap between
two steps, or between rank 0's part and a follower's reply, is often well under a millisecond,
so a waiter first polls its condition for SPIN_S (a woken process costs tens of microseconds).
After that it marks itself asleep in shared memory and blocks on a datagram socket of its own
(an abstract Unix socket: nothing on disk to clean up) that the other side writes one byte to
when it changes the condition. Blocking, not sleep-polling: an idle follower costs no CPU, which
matters on CPU instances whose ranks share cores. A lost wakeup (the two sides race, or sit in
different network namespaces) costs at most SLICE_S, since each block is that short; between
blocks the waiter checks that its peers still run (a pidfd: immune to pid reuse), so a killed
rank fails the wait within SLICE_S instead of at its timeout.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable

SPIN_S = 200e-6  # poll this long before blocking: most step gaps on one host are shorter
SLICE_S = 0.05  # the longest block: bounds a lost wakeup and how late a dead peer is noticed


class PeerGone(ConnectionError):
    """The process on the other side of a channel exited (or closed its end)."""


class ChannelTimeout(TimeoutError):
    """The other side of a channel did not answer in time (it hangs, or is far too slow)."""


class PeerWatch:
    """Tells whether peer processes on this host still run."""

    def __init__(self, pids: list[int]):
        self.pids = list(pids)
        self._fds = [_pidfd(pid) for pid in self.pids]

    def check(self) -> None:
        """PeerGone if any peer has exited."""
        for pid, fd in zip(self.pids, self._fds):
            if not _runs(pid, fd):
                raise PeerGone(f"process {pid} on the other side of the channel has exited")

    def close(self) -> None:
        for fd in self._fds:
            if fd is not None:
                os.close(fd)
        self._fds = [None] * len(self.pids)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone already, or no pidfds here: checked by pid
        return None


def _runs(pid: int, fd: int | None) -> bool:
    if fd is not None:
        readable, _, _ = select.select([fd], [], [], 0)  # a pidfd turns readable when its process exits
        return not readable
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True


def wakeup_address(name: str) -> bytes:
    """An abstract Unix socket address (Linux): it vanishes with the socket, however that ends."""
    return b"\0" + name.encode()


class Waiter:
    """One side's way to wait for a condition that the other side changes, then wakes it."""

    def __init__(self, address: bytes, set_asleep: Callable[[bool], None], peers: PeerWatch):
        """`address`: this side's wakeup socket; `set_asleep`: publish whether this side blocks
        (the other side wakes it only then); `peers`: who must still run while this side waits."""
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(address)
        self._set_asleep = set_asleep
        self.peers = peers
        self._fence_lock = threading.Lock()

    def wait(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """True once `ready()` holds; False after `timeout_s`; PeerGone when a peer exited."""
        start = time.monotonic()
        while time.monotonic() - start < SPIN_S:
            if ready():
                return True
            os.sched_yield()
        deadline = start + timeout_s
        while True:
            self._set_asleep(True)
            self.fence()  # the flag is visible before `ready` is read again: no wakeup slips between
            if ready():
                self._set_asleep(False)
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._set_asleep(False)
                return False
            self.peers.check()
            self._block(min(remaining, SLICE_S))
            self._set_asleep(False)

    def fence(self) -> None:
        """A full memory barrier (taking a lock is one): stores before it are seen before loads after it."""
        with self._fence_lock:
            pass

    def _block(self, timeout_s: float) -> None:
        self._sock.settimeout(timeout_s)
        try:
            self._sock.recv(64)  # a stale wakeup returns at once: the caller checks again
        except (TimeoutError, socket.timeout):
            pass

    def close(self) -> None:
        self._sock.close()
        self.peers.close()


class Waker:
    """Wakes a Waiter in another process (one byte to its socket); best effort, never blocks."""

    def __init__(self, address: bytes):
        self._address = address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def wake(self) -> None:
        try:
            self._sock.sendto(b"w", self._address)
        except OSError:  # not bound (yet, or any more), or its buffer is full of wakeups already
            pass

    def close(self) -> None:
        self._sock.close()
