"""The shared-memory ring that carries a TP x PP instance's steps: messages arrive whole and in
order, of any length, for every reader, across many laps of the ring; every wait ends at its
timeout, and at once when the process on the other side has exited."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest

from disagg.worker.peer_wait import ChannelTimeout, PeerGone
from disagg.worker.shm_ring import Ring, RingHandle, RingReader, RingWriter

ME = os.getpid()


def ring_pair(num_slots: int = 4, slot_bytes: int = 64, num_readers: int = 1):
    """A ring, its writer, and its readers each on their own mapping (as in another process)."""
    ring = Ring.create(num_slots, slot_bytes, num_readers)
    writer = RingWriter(ring, [ME] * num_readers)
    readers = [RingReader(Ring.attach(ring.handle), r, [ME]) for r in range(num_readers)]
    return ring, writer, readers


def read_in_thread(reader: RingReader, count: int) -> tuple[threading.Thread, list]:
    got: list = []

    def run():
        for _ in range(count):
            got.append(bytes(reader.recv(timeout_s=10)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


def test_a_message_goes_round():
    _, writer, (reader,) = ring_pair()
    writer.send(b"step 1", timeout_s=1)
    writer.send(b"", timeout_s=1)
    assert reader.recv(timeout_s=1) == b"step 1"
    assert reader.recv(timeout_s=1) == b""


def test_a_message_bigger_than_the_whole_ring_streams_through():
    _, writer, (reader,) = ring_pair(num_slots=3, slot_bytes=64)
    payload = os.urandom(64 * 40 + 17)  # 41 fragments through 3 slots
    thread, got = read_in_thread(reader, 1)
    writer.send(payload, timeout_s=10)
    thread.join(10)
    assert got == [payload]


def test_many_laps_keep_every_message_whole_and_in_order():
    _, writer, (reader,) = ring_pair(num_slots=3, slot_bytes=32)
    rng = random.Random(0)
    messages = [rng.randbytes(rng.choice([0, 1, 31, 32, 33, 100])) for _ in range(2000)]
    thread, got = read_in_thread(reader, len(messages))
    for message in messages:
        writer.send(message, timeout_s=10)
    thread.join(30)
    assert got == messages


def test_every_reader_gets_every_message():
    _, writer, readers = ring_pair(num_slots=2, slot_bytes=16, num_readers=3)
    messages = [bytes([i % 256]) * (i % 50) for i in range(300)]
    threads = [read_in_thread(reader, len(messages)) for reader in readers]
    for message in messages:
        writer.send(message, timeout_s=10)
    for thread, got in threads:
        thread.join(30)
        assert got == messages


def test_waits_end_at_their_timeout():
    _, writer, (reader,) = ring_pair(num_slots=2, slot_bytes=8)
    started = time.monotonic()
    assert reader.recv(timeout_s=0.2) is None
    assert 0.2 <= time.monotonic() - started < 1.0
    writer.send(b"x" * 16, timeout_s=1)  # fills both slots; nobody reads
    started = time.monotonic()
    with pytest.raises(ChannelTimeout):
        writer.send(b"y", timeout_s=0.2)
    assert time.monotonic() - started < 1.0


def test_a_reader_attaches_only_to_the_ring_it_was_given():
    ring = Ring.create(2, 8, 1)
    fake = RingHandle(ring.handle.pid, ring.handle.fd, ring.handle.token + 1, 2, 8, 1)
    with pytest.raises(PeerGone, match="is gone"):
        Ring.attach(fake)


# ---- a peer in another process that exits ----------------------------------------------------------
PEER = """
import sys, time
from disagg.worker.shm_ring import Ring, RingHandle, RingReader, RingWriter
role, parent = sys.argv[1], int(sys.argv[2])
if role == "reader":  # reads one message of the parent's ring, then exits
    reader = RingReader(Ring.attach(RingHandle(*map(int, sys.argv[3:]))), 0, [parent])
    print("ready", flush=True)
    reader.recv(timeout_s=10)
else:  # writes one message on a ring of its own, then lives until killed
    ring = Ring.create(2, 8, 1)
    writer = RingWriter(ring, [parent])
    print(" ".join(map(str, vars(ring.handle).values())), flush=True)
    sys.stdin.readline()
    writer.send(b"hello", timeout_s=10)
    time.sleep(60)
"""


def peer(*args) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-c", PEER, *map(str, args)]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def test_a_writer_fails_at_once_when_its_reader_exited():
    ring = Ring.create(2, 8, 1)
    child = peer("reader", ME, *vars(ring.handle).values())
    try:
        assert child.stdout.readline().strip() == "ready"
        writer = RingWriter(ring, [child.pid])
        writer.send(b"a" * 24, timeout_s=10)  # 3 fragments: the third waits for the reader's room
        child.wait(10)
        writer.send(b"b" * 16, timeout_s=10)  # into the two slots it had read
        started = time.monotonic()
        with pytest.raises(PeerGone):
            writer.send(b"c" * 8, timeout_s=60)  # the ring is full and its reader is gone
        assert time.monotonic() - started < 1.0
    finally:
        child.kill()
        child.wait()


def test_a_reader_fails_at_once_when_its_writer_was_killed():
    child = peer("writer", ME)
    try:
        handle = RingHandle(*map(int, child.stdout.readline().split()))
        reader = RingReader(Ring.attach(handle), 0, [child.pid])
        child.stdin.write("go\n")
        child.stdin.flush()
        assert reader.recv(timeout_s=10) == b"hello"
        child.kill()
        started = time.monotonic()
        with pytest.raises(PeerGone):
            reader.recv(timeout_s=60)
        assert time.monotonic() - started < 1.0
    finally:
        child.kill()
        child.wait()
