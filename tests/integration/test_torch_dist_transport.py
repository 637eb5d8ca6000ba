"""TorchDistTransport between real Ray actors: byte-exact KV blocks, timeouts, dead peers, rebuilds."""

from __future__ import annotations

import hashlib
import time

import pytest
import ray
import torch

from disagg.errors import KVTransferError
from disagg.kv_transfer.torch_dist import TorchDistTransport
from tests.support import LINK_KEY

SLACK = 2.0  # seconds an error may come after its timeout on a loaded 2-core machine
CONNECT_TIMEOUT = 20.0
FAST_FAIL_S = 3.0  # a dead peer must fail a transfer well before its timeout


def kv_blocks(num_blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """KV-like blocks [2 (K, V), blocks, block_size, kv_heads, head_dim], the same for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, 16, 8, 128, generator=gen).to(dtype)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


@ray.remote(num_cpus=0, max_concurrency=4)
class TransportPeer:
    """A worker with a TorchDistTransport; threaded, so that it can send and receive at once."""

    def __init__(self, worker_id: str):
        torch.set_num_threads(1)
        self.transport = TorchDistTransport(worker_id, LINK_KEY)

    def address(self) -> str:
        return self.transport.address()

    def connect(self, peer_id: str, address: str, timeout: float = CONNECT_TIMEOUT) -> None:
        self.transport.connect(peer_id, address, timeout)

    def send_blocks(self, peer_id: str, specs: list[tuple[int, torch.dtype, int]], timeout: float = 20.0) -> list[str]:
        digests = []
        for num_blocks, dtype, seed in specs:
            blocks = kv_blocks(num_blocks, dtype, seed)
            self.transport.send(peer_id, blocks, timeout)
            digests.append(digest(blocks))
        return digests

    def recv_blocks(
        self, peer_id: str, specs: list[tuple[int, torch.dtype, int]], timeout: float = 20.0
    ) -> list[tuple[bool, str]]:
        results = []
        for num_blocks, dtype, seed in specs:
            out = torch.empty(2, num_blocks, 16, 8, 128, dtype=dtype)
            self.transport.recv(peer_id, out, timeout)
            results.append((torch.equal(out, kv_blocks(num_blocks, dtype, seed)), digest(out)))
        return results

    def pair_is_live(self, peer_id: str) -> bool:
        return self.transport.path_to(peer_id) is not None  # a path exactly while the pair is live

    def wait_until_broken(self, peer_id: str, timeout: float) -> float:
        """Seconds until this side sees its pair with the peer broken (inf: not within `timeout`)."""
        start = time.monotonic()
        while self.pair_is_live(peer_id):
            if time.monotonic() - start > timeout:
                return float("inf")
            time.sleep(0.001)
        return time.monotonic() - start

    def timed(self, method: str, *args) -> tuple[str, float]:
        """Call a transport method that should fail: (its KVTransferError, or "", seconds taken)."""
        start = time.monotonic()
        try:
            getattr(self.transport, method)(*args)
        except KVTransferError as exc:
            return str(exc), time.monotonic() - start
        return "", time.monotonic() - start

    def recv_until_failure(self, peer_id: str, num_bytes: int, timeout: float) -> tuple[int, str, float]:
        """Receive large messages until one fails: (recvs done, the error, seconds the failing recv took)."""
        out = torch.empty(num_bytes, dtype=torch.uint8)
        count = 0
        while True:
            start = time.monotonic()
            try:
                self.transport.recv(peer_id, out, timeout)
            except KVTransferError as exc:
                return count, str(exc), time.monotonic() - start
            count += 1

    def send_until_failure(
        self, peer_id: str, num_bytes: int, timeout: float, max_seconds: float
    ) -> tuple[int, str, float]:
        """Send one large tensor again and again: (sends done, the error, seconds the failing send took)."""
        payload = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
        count, end = 0, time.monotonic() + max_seconds
        while time.monotonic() < end:
            start = time.monotonic()
            try:
                self.transport.send(peer_id, payload, timeout)
            except KVTransferError as exc:
                return count, str(exc), time.monotonic() - start
            count += 1
        return count, "", 0.0


def connect(a, a_id: str, b, b_id: str) -> None:
    """Both sides connect at once (a rendezvous)."""
    a_addr, b_addr = ray.get([a.address.remote(), b.address.remote()])
    ray.get([a.connect.remote(b_id, b_addr), b.connect.remote(a_id, a_addr)], timeout=CONNECT_TIMEOUT + 10)


@pytest.fixture(scope="module")
def peers(ray_session):
    """A prefill-like and a decode-like worker ("d0" sorts first, so the pair meets on d0's store)."""
    prefill, decode = TransportPeer.remote("p0"), TransportPeer.remote("d0")
    connect(prefill, "p0", decode, "d0")
    yield prefill, decode
    for actor in (prefill, decode):
        ray.kill(actor)


def test_kv_blocks_arrive_byte_exact_and_in_order(peers):
    prefill, decode = peers
    specs = [(16, torch.float32, 1), (16, torch.bfloat16, 2), (3, torch.float32, 3), (1, torch.bfloat16, 4)]
    sent_digests = prefill.send_blocks.remote("d0", specs)
    received = ray.get(decode.recv_blocks.remote("p0", specs), timeout=60)
    assert [equal for equal, _ in received] == [True] * len(specs)
    assert [d for _, d in received] == ray.get(sent_digests, timeout=10)
    assert len(set(ray.get(sent_digests))) == len(specs)  # four different messages, not one repeated


def test_both_directions_at_once(peers):
    prefill, decode = peers
    to_decode = [(8, torch.float32, 11), (8, torch.bfloat16, 12), (2, torch.float32, 13)]
    to_prefill = [(4, torch.bfloat16, 21), (6, torch.float32, 22), (2, torch.bfloat16, 23)]
    jobs = [
        prefill.send_blocks.remote("d0", to_decode),
        decode.send_blocks.remote("p0", to_prefill),
        decode.recv_blocks.remote("p0", to_decode),
        prefill.recv_blocks.remote("d0", to_prefill),
    ]
    sent_d, sent_p, got_d, got_p = ray.get(jobs, timeout=60)
    assert [e for e, _ in got_d] == [True] * 3 and [d for _, d in got_d] == sent_d
    assert [e for e, _ in got_p] == [True] * 3 and [d for _, d in got_p] == sent_p


def test_recv_without_sender_times_out_then_the_pair_is_rebuilt(peers):
    prefill, decode = peers
    timeout = 1.5
    assert ray.get(prefill.pair_is_live.remote("d0"))
    message, elapsed = ray.get(decode.timed.remote("recv", "p0", torch.empty(2, 1, 16, 8, 128), timeout), timeout=30)
    assert "p0" in message and "d0" in message, message
    assert timeout - 0.05 <= elapsed <= timeout + SLACK
    # The decode side dropped the pair, bumped its generation and closed the connection: the
    # prefill side sees its pair break at once (its connect trusts a live pair without asking the
    # store). Both connect again and meet under a fresh prefix.
    assert ray.get(prefill.wait_until_broken.remote("d0", 1.0)) < 1.0
    connect(prefill, "p0", decode, "d0")
    specs = [(4, torch.float32, 31)]
    sent = prefill.send_blocks.remote("d0", specs)
    assert ray.get(decode.recv_blocks.remote("p0", specs), timeout=30) == [(True, ray.get(sent)[0])]


def test_killed_receiver_fails_the_send_fast_and_a_fresh_receiver_works(peers):
    sender, _ = peers
    # "c1" sorts before "p0": the pair meets on the victim's store, which dies with it.
    victim = TransportPeer.remote("c1")
    victim_address = ray.get(victim.address.remote())
    connect(sender, "p0", victim, "c1")
    num_bytes, timeout = 64 * 2**20, 10.0
    victim.recv_until_failure.remote("p0", num_bytes, 30.0)
    sending = sender.send_until_failure.remote("c1", num_bytes, timeout, 40.0)
    time.sleep(1.5)  # let several 64 MiB sends go through
    ray.kill(victim)
    count, message, elapsed = ray.get(sending, timeout=timeout + 20)
    assert count >= 1, "no send completed before the kill"
    assert "c1" in message, message
    # gloo alone would leave a transfer under way to wait out its whole timeout; the pair's
    # watcher must end it as soon as the connection drops.
    assert elapsed < FAST_FAIL_S, f"the failing send took {elapsed:.2f}s of its {timeout}s timeout"
    # Reconnecting to the dead peer fails at once too (its store is gone with it).
    message, elapsed = ray.get(sender.timed.remote("connect", "c1", victim_address, timeout), timeout=30)
    assert "c1" in message and elapsed < FAST_FAIL_S, (message, elapsed)

    fresh = TransportPeer.remote("z1")  # sorts after "p0": this pair meets on the sender's store
    connect(sender, "p0", fresh, "z1")
    specs = [(16, torch.float32, 41)]
    sent = sender.send_blocks.remote("z1", specs)
    assert ray.get(fresh.recv_blocks.remote("p0", specs), timeout=30) == [(True, ray.get(sent)[0])]
    ray.kill(fresh)


def test_killed_sender_fails_the_recv_fast(peers):
    _, receiver = peers
    victim = TransportPeer.remote("a2")  # sorts first: the pair meets on the victim's store
    connect(victim, "a2", receiver, "d0")
    num_bytes, timeout = 64 * 2**20, 10.0
    victim.send_until_failure.remote("d0", num_bytes, 30.0, 40.0)
    receiving = receiver.recv_until_failure.remote("a2", num_bytes, timeout)
    time.sleep(1.5)
    ray.kill(victim)
    count, message, elapsed = ray.get(receiving, timeout=timeout + 20)
    assert count >= 1, "no recv completed before the kill"
    assert "a2" in message and elapsed < FAST_FAIL_S, (message, elapsed)
    # The receiver's other pair is untouched by the dead one.
    prefill, _ = peers
    specs = [(2, torch.bfloat16, 51)]
    sent = prefill.send_blocks.remote("d0", specs)
    assert ray.get(receiver.recv_blocks.remote("p0", specs), timeout=30) == [(True, ray.get(sent)[0])]
