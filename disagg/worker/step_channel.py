"""The channel rank 0 of a TP x PP instance drives its followers over, step by step, without Ray.

A Ray actor call per step (its arguments and reply through Ray's scheduler and object store)
can cost as much as the step itself, for a decode batch of one or a small model on a GPU.
So Ray keeps only the instance's lifecycle (join, expect, abort_transfers, shutdown) and the steps
go over a channel of rank 0's own, opened once when the instance starts:

- followers on rank 0's host (the usual case: an instance inside one node): one shared-memory
  ring that rank 0 writes every order on and they all read (disagg.worker.shm_ring), and one
  ring per follower for its answer;
- followers on another host: a TCP connection each, which they dial, every message on it sealed
  against forgery and replay (disagg.worker.socket_pipe).

A follower is on rank 0's host when `channel_key` is equal on both: it can then map rank 0's
memory and receive its wakeups. Each side checks that the other still runs while it waits, so a
killed rank fails the step at once, and a hung one at the caller's timeout.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from disagg.engine.shared_memory import host_key
from disagg.worker.peer_wait import ChannelTimeout
from disagg.worker.shm_ring import Ring, RingHandle, RingReader, RingWriter
from disagg.worker.socket_pipe import SocketPipe, accept_pipes, connect_pipe, listen

# Orders are small (a step's chunks: token and block ids); answers may hold a few rows of logits
# (a row is vocabulary x 4 bytes). Longer messages stream through the slots, so these bound memory,
# not message size.
ORDER_SLOTS, ORDER_SLOT_BYTES = 8, 64 << 10
ANSWER_SLOTS, ANSWER_SLOT_BYTES = 8, 512 << 10
OPEN_TIMEOUT_S = 60.0  # the ranks open their ends once they joined the instance


def channel_key() -> str:
    """Equal for two processes exactly when they can share a ring: the same host, PID namespace
    and user (one maps the other's memory) and the same network namespace (one wakes the other)."""
    host = host_key()
    try:
        network = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    return f"{host}/{network}" if host else ""


@dataclass(frozen=True)
class ChannelInvite:
    """What follower `index` needs to open its end of rank 0's channel."""

    index: int
    driver_pid: int
    order_ring: RingHandle | None = None  # on rank 0's host: the ring rank 0 writes orders on
    reader_index: int = 0  # this follower's place among that ring's readers
    answer_ring: RingHandle | None = None  # and the one this follower answers on
    host: str = ""  # on another host: where rank 0 listens
    port: int = 0


class DriverChannel:
    """Rank 0's end: each order to every follower, then an answer from each."""

    def __init__(self, order_writer: RingWriter | None, pipes: dict[int, SocketPipe], inboxes: list, rings: list[Ring]):
        """`inboxes`: by follower index, the RingReader or SocketPipe its answers come on."""
        self._order_writer = order_writer
        self._pipes = pipes
        self._inboxes = inboxes
        self._rings = rings

    def send(self, payload: bytes, timeout_s: float) -> None:
        if self._order_writer is not None:
            self._order_writer.send(payload, timeout_s)
        for pipe in self._pipes.values():
            pipe.send(payload, timeout_s)

    def recv_all(self, timeout_s: float) -> list[bytearray]:
        """Every follower's answer, by index, all within `timeout_s`."""
        answers = []
        deadline = time.monotonic() + timeout_s
        for index, inbox in enumerate(self._inboxes):
            answer = inbox.recv(max(deadline - time.monotonic(), 0.0))
            if answer is None:
                raise ChannelTimeout(f"follower {index} did not answer within {timeout_s:.0f}s")
            answers.append(answer)
        return answers

    def close(self) -> None:
        for end in [self._order_writer, *self._inboxes]:
            if end is not None:
                end.close()
        for ring in self._rings:
            ring.close()


class FollowerChannel:
    """A follower's end: orders in, answers out."""

    def __init__(self, inbox, outbox, rings: list[Ring]):
        self._inbox = inbox
        self._outbox = outbox
        self._rings = rings

    def recv(self, timeout_s: float) -> bytearray | None:
        """The next order; None if none came within `timeout_s` (an idle instance)."""
        return self._inbox.recv(timeout_s)

    def send(self, payload: bytes, timeout_s: float) -> None:
        self._outbox.send(payload, timeout_s)

    def close(self) -> None:
        self._inbox.close()
        if self._outbox is not self._inbox:
            self._outbox.close()
        for ring in self._rings:
            ring.close()


class ChannelOffer:
    """Rank 0 while its instance starts: rings for the followers on its host, a listener for the
    others, and one invite per follower; `accept` then gives the channel once all have opened
    their ends."""

    def __init__(self, followers: list[tuple[int, str]], host: str, shared_memory: bool = True):
        """`followers`: (pid, channel_key) of each follower, by index; `host`: what the listener
        binds; `shared_memory`: False sends every follower over TCP (tests of that path)."""
        mine = channel_key() if shared_memory else ""
        self.pids = [pid for pid, _ in followers]
        self.local = [i for i, (_, key) in enumerate(followers) if mine and key == mine]
        self.remote = [i for i in range(len(followers)) if i not in self.local]
        self.order_ring = Ring.create(ORDER_SLOTS, ORDER_SLOT_BYTES, len(self.local)) if self.local else None
        self.answer_rings = {i: Ring.create(ANSWER_SLOTS, ANSWER_SLOT_BYTES, 1) for i in self.local}
        self.listener = listen(host) if self.remote else None
        self.invites = [self._invite(i, host) for i in range(len(followers))]

    def _invite(self, index: int, host: str) -> ChannelInvite:
        if index in self.answer_rings:
            reader = self.local.index(index)
            return ChannelInvite(index, os.getpid(), self.order_ring.handle, reader, self.answer_rings[index].handle)
        return ChannelInvite(index, os.getpid(), host=host, port=self.listener.getsockname()[1])

    def accept(self, key: bytes, timeout_s: float) -> DriverChannel:
        """The channel, once the followers on other hosts have connected (those on this host
        need nothing more: their rings are in place)."""
        pipes = {}
        if self.listener is not None:
            try:
                pipes = accept_pipes(self.listener, len(self.remote), key, timeout_s)
            finally:
                self.listener.close()
        local_pids = [self.pids[i] for i in self.local]
        writer = RingWriter(self.order_ring, local_pids) if self.order_ring else None
        # Any follower's exit fails the wait for any answer: the others may be stuck in a
        # collective with it until the group's timeout.
        inboxes = [
            RingReader(self.answer_rings[i], 0, local_pids) if i in self.answer_rings else pipes[i]
            for i in range(len(self.pids))
        ]
        rings = [r for r in [self.order_ring, *self.answer_rings.values()] if r is not None]
        return DriverChannel(writer, pipes, inboxes, rings)


def open_follower_channel(invite: ChannelInvite, key: bytes, timeout_s: float) -> FollowerChannel:
    """A follower's end of the channel its invite names."""
    if invite.order_ring is None:
        pipe = connect_pipe(invite.host, invite.port, key, invite.index, timeout_s)
        return FollowerChannel(pipe, pipe, [])
    orders, answers = Ring.attach(invite.order_ring), Ring.attach(invite.answer_ring)
    inbox = RingReader(orders, invite.reader_index, [invite.driver_pid])
    outbox = RingWriter(answers, [invite.driver_pid])
    return FollowerChannel(inbox, outbox, [orders, answers])
