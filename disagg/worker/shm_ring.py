"""A ring of fixed-size slots in shared memory: one writer, a fixed set of readers, one host.

Rank 0 of a TP x PP instance hands each step to its followers on a ring like this, and each
follower its reply back on one of its own, instead of a Ray call per step: a message costs a
copy in and a copy out, and a reader that is already waiting sees it within microseconds.

The memory is an anonymous memfd, mapped by the other processes through /proc/<pid>/fd/<fd>,
as the shared KV cache is (disagg.engine.shared_memory, which says why: no file to leak, freed
when the last process lets go); its name carries a random token a peer checks. The ring needs
raw bytes rather than a tensor, so it maps the memfd itself. Layout:

    header   magic, number of slots, number of readers, slot size
    asleep   one byte per reader, then the writer's: set while it blocks (disagg.worker.peer_wait)
    acks     per reader, per slot: the sequence number of the fragment it last read there
    slots    per slot: sequence number, message length, fragment length, then the fragment

The ring's k-th fragment (counting from 1) goes into slot (k - 1) % num_slots under sequence
number k. A message longer than a slot is cut into fragments over consecutive slots, so any size
works; the writer refills a slot only once every reader acknowledged what it held, so the ring
bounds memory and a slow reader holds the writer back (within the writer's timeout). Every
number is written by one side only, and the other side compares it for equality with the one it
expects, so a torn read can never pass for it.
"""

from __future__ import annotations

import mmap
import os
import secrets
import struct
from dataclasses import dataclass

from disagg.worker.peer_wait import ChannelTimeout, PeerGone, PeerWatch, Waiter, Waker, wakeup_address

MAGIC = 0x646973616767_7231  # "disagg" + "r1"
_HEADER = struct.Struct("<QIIQ")  # magic, num_slots, num_readers, slot_bytes
_SEQ = struct.Struct("<Q")  # a slot's header: its sequence number, then _LENGTHS
_LENGTHS = struct.Struct("<QQ")  # message length, fragment length
_ALIGN = 64  # one cache line: each side's counters stay off the other's lines
MORE_TIMEOUT_S = 30.0  # a message's later fragments follow its first at the writer's pace


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class RingHandle:
    """What a process on the same host needs to map a ring."""

    pid: int
    fd: int
    token: int  # random, in the memfd's name
    num_slots: int
    slot_bytes: int
    num_readers: int

    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"

    def name(self) -> str:
        return f"disagg-ring-{self.token:016x}"

    def wakeup(self, side: str) -> bytes:
        """The wakeup socket of `side`: "w" (the writer) or "r<index>" (a reader)."""
        return wakeup_address(f"{self.name()}-{side}")

    @property
    def num_bytes(self) -> int:
        return _Layout(self).total


class _Layout:
    def __init__(self, h: RingHandle):
        self.asleep = _ALIGN
        self.acks = self.asleep + _aligned(h.num_readers + 1)
        self.slots = self.acks + _aligned(8 * h.num_readers * h.num_slots)
        self.slot_stride = _ALIGN + _aligned(h.slot_bytes)
        self.total = self.slots + h.num_slots * self.slot_stride


class Ring:
    """A mapping of a ring's memory (the creator also holds the memfd that peers open)."""

    def __init__(self, memory: mmap.mmap, handle: RingHandle, owned_fd: int | None = None):
        self.handle = handle
        self.layout = _Layout(handle)
        self._memory = memory
        self.view = memoryview(memory)
        self._owned_fd = owned_fd

    @classmethod
    def create(cls, num_slots: int, slot_bytes: int, num_readers: int) -> "Ring":
        if num_slots < 1 or slot_bytes < 1 or num_readers < 1:
            raise ValueError("a ring needs at least one slot of at least one byte, and a reader")
        token = secrets.randbits(63)
        fd = os.memfd_create(f"disagg-ring-{token:016x}", os.MFD_CLOEXEC)
        handle = RingHandle(os.getpid(), fd, token, num_slots, slot_bytes, num_readers)
        try:
            os.ftruncate(fd, handle.num_bytes)
            memory = mmap.mmap(fd, handle.num_bytes)
        except BaseException:
            os.close(fd)
            raise
        _HEADER.pack_into(memory, 0, MAGIC, num_slots, num_readers, slot_bytes)
        return cls(memory, handle, fd)

    @classmethod
    def attach(cls, handle: RingHandle) -> "Ring":
        """Map a ring another process created; PeerGone when it is not there any more."""
        try:
            if os.readlink(handle.path()) != f"/memfd:{handle.name()} (deleted)":
                raise PeerGone(f"ring {handle.name()} is gone (pid {handle.pid} fd {handle.fd} is something else)")
            fd = os.open(handle.path(), os.O_RDWR)
        except OSError as exc:
            raise PeerGone(f"cannot open ring {handle.name()} of pid {handle.pid}: {exc}") from exc
        try:
            memory = mmap.mmap(fd, handle.num_bytes)
        finally:
            os.close(fd)  # the mapping keeps the memory
        if _HEADER.unpack_from(memory, 0) != (MAGIC, handle.num_slots, handle.num_readers, handle.slot_bytes):
            memory.close()
            raise ValueError(f"ring {handle.name()} does not have the shape its handle says")
        return cls(memory, handle)

    # ---- the counters --------------------------------------------------------------------------
    def slot_of(self, seq: int) -> int:
        return (seq - 1) % self.handle.num_slots

    def seq_at(self, slot: int) -> int:
        return _SEQ.unpack_from(self.view, self._slot_offset(slot))[0]

    def ack_at(self, reader: int, slot: int) -> int:
        return _SEQ.unpack_from(self.view, self._ack_offset(reader, slot))[0]

    def set_ack(self, reader: int, slot: int, seq: int) -> None:
        _SEQ.pack_into(self.view, self._ack_offset(reader, slot), seq)

    def asleep(self, side: int) -> bool:
        """`side`: a reader's index, or num_readers for the writer."""
        return self.view[self.layout.asleep + side] != 0

    def set_asleep(self, side: int, asleep: bool) -> None:
        self.view[self.layout.asleep + side] = 1 if asleep else 0

    # ---- the fragments --------------------------------------------------------------------------
    def put(self, slot: int, seq: int, message_length: int, fragment, fence) -> None:
        """Write a fragment, then (after `fence`) its sequence number: a reader that sees the
        number sees the bytes."""
        offset = self._slot_offset(slot)
        self.view[offset + _ALIGN : offset + _ALIGN + len(fragment)] = fragment
        _LENGTHS.pack_into(self.view, offset + _SEQ.size, message_length, len(fragment))
        fence()
        _SEQ.pack_into(self.view, offset, seq)

    def lengths(self, slot: int) -> tuple[int, int]:
        """(message length, fragment length) of what the slot holds."""
        return _LENGTHS.unpack_from(self.view, self._slot_offset(slot) + _SEQ.size)

    def fragment(self, slot: int, length: int) -> memoryview:
        start = self._slot_offset(slot) + _ALIGN
        return self.view[start : start + length]

    def _slot_offset(self, slot: int) -> int:
        return self.layout.slots + slot * self.layout.slot_stride

    def _ack_offset(self, reader: int, slot: int) -> int:
        return self.layout.acks + 8 * (reader * self.handle.num_slots + slot)

    def close(self) -> None:
        try:
            self.view.release()
            self._memory.close()
        except BufferError:  # another thread still reads it (an instance stopping mid-step): unmapped when unused
            pass
        if self._owned_fd is not None:
            os.close(self._owned_fd)
            self._owned_fd = None


class RingWriter:
    """The ring's one writer; `peer_pids`: the processes whose exit fails a send (its readers)."""

    def __init__(self, ring: Ring, peer_pids: list[int]):
        h = ring.handle
        self.ring = ring
        self._side = h.num_readers
        self._waiter = Waiter(h.wakeup("w"), lambda a: ring.set_asleep(self._side, a), PeerWatch(peer_pids))
        self._readers = [Waker(h.wakeup(f"r{r}")) for r in range(h.num_readers)]
        self._next_seq = 1

    def send(self, payload, timeout_s: float) -> None:
        """Put a message of any length on the ring; ChannelTimeout when a reader does not make
        room in time, PeerGone when one exited."""
        data = memoryview(payload).cast("B")
        slot_bytes = self.ring.handle.slot_bytes
        start = 0
        while True:
            fragment = data[start : start + slot_bytes]
            self._put(fragment, len(data), timeout_s)
            start += len(fragment)
            if start >= len(data):
                return

    def _put(self, fragment: memoryview, message_length: int, timeout_s: float) -> None:
        seq, ring = self._next_seq, self.ring
        slot = ring.slot_of(seq)
        if not self._waiter.wait(lambda: self._is_free(slot, seq), timeout_s):
            raise ChannelTimeout(f"ring {ring.handle.name()}: a reader did not make room within {timeout_s:.0f}s")
        ring.put(slot, seq, message_length, fragment, self._waiter.fence)
        self._next_seq = seq + 1
        self._waiter.fence()  # the number is out before the readers' flags are read
        for reader, waker in enumerate(self._readers):
            if ring.asleep(reader):
                waker.wake()

    def _is_free(self, slot: int, seq: int) -> bool:
        """Every reader acknowledged the fragment the slot held a lap ago (none on the first lap)."""
        previous = seq - self.ring.handle.num_slots
        return previous < 1 or all(self.ring.ack_at(r, slot) == previous for r in range(self.ring.handle.num_readers))

    def close(self) -> None:
        self._waiter.close()
        for waker in self._readers:
            waker.close()


class RingReader:
    """Reader `index` of a ring; `peer_pids`: the processes whose exit fails a receive (its
    writer, and any other the message waits on)."""

    def __init__(self, ring: Ring, index: int, peer_pids: list[int]):
        h = ring.handle
        if not 0 <= index < h.num_readers:
            raise ValueError(f"reader {index}: the ring has {h.num_readers} readers")
        self.ring = ring
        self.index = index
        self._waiter = Waiter(h.wakeup(f"r{index}"), lambda a: ring.set_asleep(index, a), PeerWatch(peer_pids))
        self._writer = Waker(h.wakeup("w"))
        self._next_seq = 1

    def recv(self, timeout_s: float) -> bytearray | None:
        """The next message; None if none began within `timeout_s`. Once one began, its other
        fragments must follow within MORE_TIMEOUT_S each (else ChannelTimeout)."""
        if not self._wait_next(timeout_s):
            return None
        message_length, _ = self.ring.lengths(self.ring.slot_of(self._next_seq))
        message = bytearray(message_length)
        received = self._take(message, 0)
        while received < message_length:
            if not self._wait_next(MORE_TIMEOUT_S):
                raise ChannelTimeout(f"ring {self.ring.handle.name()}: a message stopped half way")
            received = self._take(message, received)
        return message

    def _wait_next(self, timeout_s: float) -> bool:
        seq, ring = self._next_seq, self.ring
        slot = ring.slot_of(seq)
        if not self._waiter.wait(lambda: ring.seq_at(slot) == seq, timeout_s):
            return False
        self._waiter.fence()  # the fragment's bytes are read after its number
        return True

    def _take(self, message: bytearray, received: int) -> int:
        """Copy the next fragment into `message` at `received`, acknowledge it; bytes received."""
        seq, ring = self._next_seq, self.ring
        slot = ring.slot_of(seq)
        _, length = ring.lengths(slot)
        message[received : received + length] = ring.fragment(slot, length)
        self._waiter.fence()  # copied out before the writer may reuse the slot
        ring.set_ack(self.index, slot, seq)
        self._next_seq = seq + 1
        self._waiter.fence()
        if ring.asleep(ring.handle.num_readers):
            self._writer.wake()
        return received + length

    def close(self) -> None:
        self._waiter.close()
        self._writer.close()
