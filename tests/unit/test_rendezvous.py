"""The KV rendezvous store: only a peer of the same deployment, for a pair that includes the
store's worker, can read or write a key; pairs do not see each other's keys (real sockets)."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
import torch

from disagg.auth import AuthenticationError
from disagg.kv_transfer.rendezvous import Rendezvous, connect_pair_store
from disagg.kv_transfer.torch_dist import TorchDistTransport
from tests.support import LINK_KEY

PAIR = "a@127.0.0.1:1/b@127.0.0.1:2"


@pytest.fixture
def rendezvous():
    owner = Rendezvous("a", LINK_KEY, "127.0.0.1")
    owner.own_address = "127.0.0.1:1"
    yield owner
    owner.close()


def test_a_peer_with_the_key_shares_the_pairs_keys(rendezvous):
    local = rendezvous.pair_store(PAIR, timeout_s=5)
    remote = connect_pair_store("127.0.0.1", rendezvous.port, PAIR, LINK_KEY, timeout_s=5)
    local.set("x", b"1")
    assert remote.get("x") == b"1"
    assert remote.add("n", 2) == 2 and local.add("n", 1) == 3
    assert remote.compare_set("g", "", "0") == b"0" and local.compare_set("g", "0", "1") == b"1"
    assert remote.compare_set("g", "0", "5") == b"1"  # lost the race: the current value comes back
    remote.close()


def test_a_caller_without_the_key_reads_and_writes_nothing(rendezvous):
    rendezvous.pair_store(PAIR, timeout_s=5).set("secret", b"kept")
    with pytest.raises(AuthenticationError):
        connect_pair_store("127.0.0.1", rendezvous.port, PAIR, bytes(32), timeout_s=5)
    remote = connect_pair_store("127.0.0.1", rendezvous.port, PAIR, LINK_KEY, timeout_s=5)
    assert remote.get("secret") == b"kept"
    remote.close()


def test_a_pair_that_does_not_start_with_the_owner_is_refused(rendezvous):
    for name in ("c@127.0.0.1:3/d@127.0.0.1:4", "0@127.0.0.1:0/a@127.0.0.1:1"):
        with pytest.raises(ConnectionError):
            connect_pair_store("127.0.0.1", rendezvous.port, name, LINK_KEY, timeout_s=5)


def test_worker_ids_may_hold_slashes():
    owner = Rendezvous("p-0/rank1", LINK_KEY, "127.0.0.1")
    owner.own_address = "127.0.0.1:1"
    name = "p-0/rank1@127.0.0.1:1/q-0/rank1@127.0.0.1:2"
    try:
        connect_pair_store("127.0.0.1", owner.port, name, LINK_KEY, timeout_s=5).set("x", b"1")
        assert owner.pair_store(name, timeout_s=5).get("x") == b"1"
    finally:
        owner.close()


def test_pairs_do_not_see_each_others_keys(rendezvous):
    rendezvous.pair_store(PAIR, timeout_s=5).set("x", b"1")
    other = connect_pair_store("127.0.0.1", rendezvous.port, "a@127.0.0.1:1/c@127.0.0.1:3", LINK_KEY, timeout_s=0.5)
    assert not other.check(["x"])
    with pytest.raises(RuntimeError, match="not set within"):
        other.get("x")  # waits the store's timeout, then fails
    other.close()


def test_garbage_from_a_stranger_leaves_the_store_serving(rendezvous):
    with socket.create_connection(("127.0.0.1", rendezvous.port), timeout=5) as raw:
        raw.sendall(struct.pack(">I", 1 << 30))  # a frame far over the limit
        raw.settimeout(5)
        assert raw.recv(1) == b""  # hung up on
    remote = connect_pair_store("127.0.0.1", rendezvous.port, PAIR, LINK_KEY, timeout_s=5)
    remote.set("y", b"2")
    assert rendezvous.pair_store(PAIR, timeout_s=5).get("y") == b"2"
    remote.close()


def test_transports_of_different_deployments_cannot_pair():
    a, b = TorchDistTransport("a", LINK_KEY), TorchDistTransport("b", bytes(32))
    try:
        with pytest.raises(Exception, match="not of this deployment"):
            b.connect("a", a.address(), timeout=5)  # "a" owns the store: b must prove the key to it
        c = TorchDistTransport("c", LINK_KEY)
        try:
            joined = threading.Thread(target=a.connect, args=("c", c.address(), 10))
            joined.start()
            c.connect("a", a.address(), timeout=10)
            joined.join()
            sent = threading.Thread(target=c.send, args=("a", torch.arange(4.0), 5))
            sent.start()
            out = torch.empty(4)
            a.recv("c", out, timeout=5)
            sent.join()
            assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
        finally:
            c.close()
    finally:
        a.close()
        b.close()
