"""TorchDistTransport with both peers in this process (threads): the message format and pair lifecycle.

The same transport between real Ray actors, with killed peers, is in tests/integration.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from disagg.auth import FrameSeal
from disagg.errors import KVTransferError
from disagg.kv_transfer.paths import DeviceView, KVPath
from disagg.kv_transfer.torch_dist import TorchDistTransport
from tests.support import LINK_KEY

SLACK = 1.0


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as executor:
        yield executor


@pytest.fixture
def pair(pool):
    a, b = TorchDistTransport("a", LINK_KEY), TorchDistTransport("b", LINK_KEY)
    connect(pool, a, b)
    yield a, b
    a.close()
    b.close()


def connect(pool, a, b, timeout: float = 10.0) -> None:
    joining = pool.submit(b.connect, a.worker_id, a.address(), timeout)
    a.connect(b.worker_id, b.address(), timeout)
    joining.result(timeout=timeout)


def transfer(pool, sender, receiver, tensor: torch.Tensor, out: torch.Tensor, timeout: float = 10.0) -> None:
    sending = pool.submit(sender.send, receiver.worker_id, tensor, timeout)
    receiver.recv(sender.worker_id, out, timeout)
    sending.result(timeout=timeout)


def wait_until_broken(transport, peer_id: str, timeout: float = SLACK) -> None:
    """The side that did not see a failure sees its pair break when the other side drops it.
    (`path_to` names a path exactly while the pair is live.)"""
    end = time.monotonic() + timeout
    while transport.path_to(peer_id) is not None:
        assert time.monotonic() < end, (
            f"{transport.worker_id}'s pair with {peer_id} is still live {timeout}s after the peer dropped it"
        )
        time.sleep(0.001)


def expect_error(fn, *args) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(KVTransferError) as info:
        fn(*args)
    return str(info.value), time.monotonic() - start


def test_address_is_the_bound_host_and_a_listening_port():
    transport = TorchDistTransport("a", LINK_KEY)
    host, port = transport.address().rsplit(":", 1)
    assert host == "127.0.0.1"
    socket.create_connection((host, int(port)), timeout=2).close()
    transport.close()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5),  # inline in the header's message
        torch.randn(2, 4, 16, 8, 128).to(torch.bfloat16),  # a separate payload message
        torch.randn(64, 129).t(),  # non-contiguous, separate
        torch.randn(6, 4).t(),  # non-contiguous, inline
        torch.tensor(7, dtype=torch.int64),  # 0-dim
        torch.empty(0, 3),  # no payload at all
        torch.tensor([True, False, True]),
    ],
    ids=["small", "large-bf16", "large-strided", "small-strided", "scalar", "empty", "bool"],
)
def test_tensor_arrives_exactly(pool, pair, tensor):
    a, b = pair
    out = torch.empty_like(tensor) if tensor.is_contiguous() else torch.empty(tensor.t().shape, dtype=tensor.dtype).t()
    transfer(pool, a, b, tensor, out)
    assert out.shape == tensor.shape and torch.equal(out, tensor)


def test_messages_keep_their_order_in_both_directions(pool, pair):
    a, b = pair
    to_b = [torch.full((4,), float(i)) for i in range(5)] + [torch.full((300_000,), 9.0)]
    to_a = [torch.full((2, 2), float(-i)) for i in range(6)]
    jobs = [
        pool.submit(lambda: [a.send("b", t, 10) for t in to_b]),
        pool.submit(lambda: [b.send("a", t, 10) for t in to_a]),
    ]
    got_a = []
    for t in to_a:
        out = torch.empty_like(t)
        a.recv("b", out, 10)
        got_a.append(out)
    for t in to_b:
        out = torch.empty_like(t)
        b.recv("a", out, 10)
        assert torch.equal(out, t)
    for job in jobs:
        job.result(timeout=10)
    assert all(torch.equal(x, y) for x, y in zip(got_a, to_a))


@pytest.mark.parametrize("size", [10, 100_000], ids=["inline", "separate"])
def test_mismatch_fails_without_crashing_and_the_pair_is_rebuilt(pool, pair, size):
    a, b = pair
    sending = pool.submit(a.send, "b", torch.ones(size), 5)
    message, _ = expect_error(b.recv, "a", torch.empty(size // 2), 5)
    assert "mismatch" in message and f"float32[{size}]" in message and f"float32[{size // 2}]" in message
    try:
        sending.result(timeout=5)  # a separate payload fails; an inline one was already delivered
    except KVTransferError:
        pass
    wait_until_broken(a, "b")
    connect(pool, a, b)
    out = torch.empty(size)
    transfer(pool, a, b, torch.full((size,), 3.0), out)
    assert out.eq(3.0).all()


def test_recv_timeout_then_stale_peer_fails_at_once_then_rebuild(pool, pair):
    a, b = pair
    message, elapsed = expect_error(b.recv, "a", torch.empty(4), 0.5)
    assert "b <-> a" in message and "Timed out" in message
    assert 0.45 <= elapsed < 0.5 + SLACK
    message, elapsed = expect_error(a.send, "b", torch.empty(4), 5)  # a's pair is the broken one
    assert elapsed < SLACK, message
    connect(pool, a, b)
    out = torch.empty(4)
    transfer(pool, a, b, torch.arange(4.0), out)
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_not_connected_and_bad_input():
    a = TorchDistTransport("a", LINK_KEY)
    with pytest.raises(KVTransferError, match="not connected"):
        a.send("b", torch.ones(1), 1)
    with pytest.raises(ValueError, match="itself"):
        a.connect("a", a.address(), 1)
    with pytest.raises(ValueError, match="host:port"):
        a.connect("z", "nonsense", 1)
    with pytest.raises(ValueError, match="backend"):
        TorchDistTransport("x", LINK_KEY, backend="mpi")
    a.close()


def test_unsupported_dtype_is_refused_before_sending(pool, pair):
    a, b = pair
    with pytest.raises(ValueError, match="dtype"):
        a.send("b", torch.ones(2, dtype=torch.complex64), 1)
    out = torch.empty(2)
    transfer(pool, a, b, torch.ones(2), out)  # the pair is untouched
    assert out.tolist() == [1.0, 1.0]


def test_connect_without_peer_times_out_and_to_a_closed_peer_fails_at_once():
    a, b = TorchDistTransport("a", LINK_KEY), TorchDistTransport("b", LINK_KEY)
    message, elapsed = expect_error(a.connect, "b", b.address(), 0.5)
    assert "did not join" in message and 0.45 <= elapsed < 0.5 + SLACK
    address = a.address()
    a.close()
    message, elapsed = expect_error(b.connect, "a", address, 5)  # "a" owns the store
    assert "Connection refused" in message and elapsed < SLACK  # nothing listens any more
    with pytest.raises(KVTransferError, match="closed"):
        a.connect("b", b.address(), 1)
    b.close()


def test_disconnect_fails_the_peers_pending_recv_at_once(pool, pair):
    a, b = pair
    receiving = pool.submit(expect_error, b.recv, "a", torch.empty(4), 10)
    time.sleep(0.2)
    a.disconnect("b")
    message, elapsed = receiving.result(timeout=5)
    assert elapsed < 0.2 + SLACK, message


def test_nccl_backend_refuses_cpu_tensors(pool):
    a, b = TorchDistTransport("a", LINK_KEY, backend="nccl"), TorchDistTransport("b", LINK_KEY, backend="nccl")
    connect(pool, a, b)  # the gloo group (rendezvous, watcher) exists whatever the backend
    with pytest.raises(ValueError, match="CUDA"):
        a.send("b", torch.ones(2), 1)
    a.close()
    b.close()


def test_an_idle_pair_outlives_its_connect_timeout():
    """A pair stays usable however long it idles: the connect call's timeout bounds the meeting
    only, not the pair's later operations or its idle watcher."""
    import threading
    import time

    from disagg.kv_transfer.torch_dist import TorchDistTransport

    with TorchDistTransport("idle-a", LINK_KEY) as a, TorchDistTransport("idle-b", LINK_KEY) as b:
        waiting = threading.Thread(target=b.connect, args=("idle-a", a.address(), 1.0))
        waiting.start()
        a.connect("idle-b", b.address(), 1.0)
        waiting.join()
        time.sleep(2.0)  # idle for twice the connect timeout
        out = torch.empty(4)
        sender = threading.Thread(target=b.send, args=("idle-a", torch.ones(4), 5.0))
        sender.start()
        a.recv("idle-b", out, 5.0)  # the same pair, not rebuilt
        sender.join()
        assert torch.equal(out, torch.ones(4))


@pytest.fixture
def sealed_pair(pool):
    """A pair whose messages carry integrity tags although both peers share a host (seal="always":
    what pairs across hosts do)."""
    a = TorchDistTransport("a", LINK_KEY, seal="always")
    b = TorchDistTransport("b", LINK_KEY, seal="always")
    connect(pool, a, b)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("size", [10, 300_000], ids=["inline", "separate"])
def test_a_sealed_pair_carries_tensors_exactly_in_both_directions(pool, sealed_pair, size):
    a, b = sealed_pair
    assert a._pairs["b"].seals is not None and b._pairs["a"].seals is not None
    for sender, receiver in ((a, b), (b, a), (a, b)):
        tensor, out = torch.randn(size), torch.empty(size)
        transfer(pool, sender, receiver, tensor, out)
        assert torch.equal(out, tensor)


@pytest.mark.parametrize("size", [10, 300_000], ids=["inline", "separate"])
@pytest.mark.parametrize("forgery", ["other key", "replayed or dropped"])
def test_a_message_that_fails_its_tag_fails_the_transfer_and_the_pair_is_rebuilt(pool, sealed_pair, size, forgery):
    a, b = sealed_pair
    if forgery == "other key":  # a sender without the pair's keys
        a._pairs["b"].seals.outgoing = FrameSeal(b"not the pair's key" * 2)
    else:  # the receiver's count is ahead: it expects the message after this one
        b._pairs["a"].seals.incoming.tag(b"a message it saw before")
    sending = pool.submit(a.send, "b", torch.ones(size), 5)
    message, _ = expect_error(b.recv, "a", torch.empty(size), 5)
    assert "integrity check" in message
    try:
        sending.result(timeout=5)  # delivered before the check, or failed as the pair went
    except KVTransferError:
        pass
    wait_until_broken(a, "b")  # the receiver dropped the pair: nothing more is read from it
    connect(pool, a, b)
    out = torch.empty(size)
    transfer(pool, a, b, torch.full((size,), 2.0), out)
    assert out.eq(2.0).all()


def test_pairs_on_one_host_are_not_sealed(pair):
    a, b = pair
    assert a._pairs["b"].seals is None and b._pairs["a"].seals is None


# Stand-in device views (kv_transfer.paths): what each side's process would see.
ONE_HOST = "boot/ns/uid"
GPU_A, GPU_B = "GPU-a", "GPU-b"


@pytest.mark.parametrize(
    "view_a, view_b, a_to_b, b_to_a",
    [
        (DeviceView(ONE_HOST), DeviceView(ONE_HOST), KVPath.SHARED_MEMORY, KVPath.SHARED_MEMORY),
        # Ray-isolated GPUs of one host: each process sees only its own.
        (DeviceView(ONE_HOST, GPU_A, (GPU_A,)), DeviceView(ONE_HOST, GPU_B, (GPU_B,)), KVPath.NCCL, KVPath.NCCL),
        # b sees a's GPU and can read it; a does not see b's.
        (
            DeviceView(ONE_HOST, GPU_A, (GPU_A,)),
            DeviceView(ONE_HOST, GPU_B, (GPU_A, GPU_B), (GPU_A,)),
            KVPath.CUDA_IPC,
            KVPath.NCCL,
        ),
    ],
    ids=["cpu", "isolated-gpus", "one-way-visible"],
)
def test_both_sides_of_a_pair_choose_the_same_paths_from_each_others_devices(pool, view_a, view_b, a_to_b, b_to_a):
    a = TorchDistTransport("a", LINK_KEY, view=view_a)
    b = TorchDistTransport("b", LINK_KEY, view=view_b)
    try:
        assert a.path_to("b") is None  # not connected yet
        connect(pool, a, b)
        assert (a.path_to("b"), b.path_to("a")) == (a_to_b, b_to_a)
        assert (a.paths(), b.paths()) == ({"b": a_to_b.value}, {"a": b_to_a.value})
        out = torch.empty(4)  # CPU tensors still go over gloo, whatever the path says of the caches
        transfer(pool, a, b, torch.arange(4.0), out)
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        a.close()
        b.close()
