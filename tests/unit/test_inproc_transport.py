"""InProcessTransport: the same observable semantics as the torch.distributed transport."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from disagg.errors import KVTransferError
from disagg.kv_transfer.inproc import InProcessHub, InProcessTransport

SLACK = 0.5  # seconds a timeout may overrun on a loaded 2-core machine


def connected_pair(hub: InProcessHub):
    a, b = InProcessTransport("a", hub), InProcessTransport("b", hub)
    a.connect("b", b.address(), timeout=1)
    b.connect("a", a.address(), timeout=1)
    return a, b


def expect_error(fn, *args) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(KVTransferError) as info:
        fn(*args)
    return str(info.value), time.monotonic() - start


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as executor:
        yield executor


def test_messages_arrive_in_order_and_are_copies(pool):
    a, b = connected_pair(InProcessHub())
    sent = [torch.full((2, 3), float(i)) for i in range(5)]

    def send_all():
        for tensor in sent:
            a.send("b", tensor, timeout=2)
            tensor.fill_(-1.0)  # the transport must have copied it

    sender = pool.submit(send_all)
    got = []
    for _ in sent:
        out = torch.empty(2, 3)
        b.recv("a", out, timeout=2)
        got.append(out[0, 0].item())
    sender.result(timeout=2)
    assert got == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_send_is_a_rendezvous_by_default(pool):
    a, b = connected_pair(InProcessHub())
    sender = pool.submit(a.send, "b", torch.ones(3), 2)
    time.sleep(0.2)
    assert not sender.done()  # no receiver yet
    out = torch.zeros(3)
    b.recv("a", out, timeout=2)
    sender.result(timeout=2)
    assert out.tolist() == [1.0, 1.0, 1.0]


def test_bounded_queue_buffers_then_send_times_out():
    a, b = connected_pair(InProcessHub(max_queue=2))
    a.send("b", torch.tensor([1.0]), timeout=0.5)
    a.send("b", torch.tensor([2.0]), timeout=0.5)
    message, elapsed = expect_error(a.send, "b", torch.tensor([3.0]), 0.3)
    assert "timed out" in message and "b" in message
    assert 0.3 <= elapsed < 0.3 + SLACK


def test_both_directions_at_once(pool):
    a, b = connected_pair(InProcessHub())
    x, y = torch.randn(4, 8), torch.randn(16)
    out_x, out_y = torch.empty_like(x), torch.empty_like(y)
    jobs = [
        pool.submit(a.send, "b", x, 2),
        pool.submit(b.send, "a", y, 2),
        pool.submit(a.recv, "b", out_y, 2),
        pool.submit(b.recv, "a", out_x, 2),
    ]
    for job in jobs:
        job.result(timeout=3)
    assert torch.equal(out_x, x) and torch.equal(out_y, y)


@pytest.mark.parametrize("out", [torch.empty(2, 4), torch.empty(2, 3, dtype=torch.bfloat16)], ids=["shape", "dtype"])
def test_mismatched_message_fails_both_sides_and_resets_the_pair(pool, out):
    a, b = connected_pair(InProcessHub())
    sender = pool.submit(a.send, "b", torch.ones(2, 3), 2)
    message, _ = expect_error(b.recv, "a", out, 2)
    assert "mismatch" in message and "float32[2, 3]" in message
    with pytest.raises(KVTransferError, match="reset"):
        sender.result(timeout=2)
    # Both sides now hold no pair; after reconnecting, the pair works again.
    with pytest.raises(KVTransferError, match="not connected"):
        a.send("b", torch.ones(2, 3), timeout=0.1)
    a.connect("b", b.address(), timeout=1)
    b.connect("a", a.address(), timeout=1)
    sender = pool.submit(a.send, "b", torch.ones(2, 3), 2)
    good = torch.zeros(2, 3)
    b.recv("a", good, timeout=2)
    sender.result(timeout=2)
    assert good.sum().item() == 6.0


def test_recv_timeout_is_measured_and_resets_the_pair_for_the_peer_too():
    a, b = connected_pair(InProcessHub())
    message, elapsed = expect_error(b.recv, "a", torch.empty(3), 0.4)
    assert "timed out" in message and "a" in message
    assert 0.4 <= elapsed < 0.4 + SLACK
    # The sender still believes in the old pair: its next op fails at once, as with gloo.
    message, elapsed = expect_error(a.send, "b", torch.empty(3), 5)
    assert "reset" in message and elapsed < SLACK


def test_kill_fails_pending_and_later_operations_at_once(pool):
    hub = InProcessHub()
    a, b = connected_pair(hub)
    c = InProcessTransport("c", hub)
    c.connect("a", a.address(), timeout=1)
    started = threading.Event()

    def blocked_recv():
        started.set()
        return expect_error(b.recv, "a", torch.empty(3), 10)

    pending = pool.submit(blocked_recv)
    started.wait(1)
    time.sleep(0.1)
    hub.kill("a")
    message, elapsed = pending.result(timeout=2)
    assert "peer is dead" in message and elapsed < 1.0  # not the 10 s timeout
    message, elapsed = expect_error(c.send, "a", torch.empty(3), 10)
    assert "peer is dead" in message and elapsed < SLACK
    message, elapsed = expect_error(b.connect, "a", "inproc://a", 10)
    assert "dead" in message and elapsed < SLACK


def test_connect_waits_for_the_peer_to_exist(pool):
    hub = InProcessHub()
    a = InProcessTransport("a", hub)
    message, elapsed = expect_error(a.connect, "ghost", "inproc://ghost", 0.3)
    assert "ghost" in message and 0.3 <= elapsed < 0.3 + SLACK
    joining = pool.submit(a.connect, "late", "inproc://late", 2)
    time.sleep(0.1)
    InProcessTransport("late", hub)
    joining.result(timeout=2)


def test_disconnect_resets_the_peer_side():
    a, b = connected_pair(InProcessHub(max_queue=1))
    a.disconnect("b")
    message, _ = expect_error(b.send, "a", torch.empty(1), 1)
    assert "reset" in message
    with pytest.raises(KVTransferError, match="not connected"):
        a.recv("b", torch.empty(1), timeout=0.1)
