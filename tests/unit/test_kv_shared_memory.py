"""KV by reference between workers on one host: the shared prefill cache, mapping it from
another process, the one-pass block copy, and a reference the sender no longer honours."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from disagg.engine.kv_cache import KVCache
from disagg.errors import KVTransferError
from disagg.kv_transfer.inproc import InProcessHub, InProcessTransport
from disagg.kv_transfer.messages import BlockRef, Header, MsgType
from disagg.engine.layers.cpu_kernels import cpu_ops
from disagg.kv_transfer.receiver import KVReceiver, copy_blocks
from disagg.kv_transfer.layout import KVTarget
from disagg.kv_transfer.sender import KVSender
from disagg.engine.shared_memory import SharedHandle, host_key, shared_zeros
from disagg.kv_transfer.shared_memory import attach

SHAPE = (2, 2, 3, 8, 4, 5)  # layers, K/V, heads, blocks, block size, head dim

CHILD = """
import sys, torch
from disagg.kv_transfer.shared_memory import SharedHandle, attach
pid, fd, token = map(int, sys.argv[1:4])
t = attach(SharedHandle(pid, fd, token), {shape}, torch.float32)
print(float(t.sum()))
t[0, 0, 0, 0, 0, 0] = -1.0  # visible to the owner: the same memory
import threading  # exit only once attach's page-touching thread is done (a busy host: it may still run)
for thread in threading.enumerate():
    if thread.name == "kv-map-pages":
        thread.join(60)
"""


def connected(endpoint, cache: KVCache):
    """A sender or receiver given its cache, as the engine gives it."""
    endpoint.register_kv_cache(cache)
    return endpoint


def test_another_process_maps_the_shared_cache_and_writes_through():
    cache = KVCache(*SHAPE[:1], SHAPE[3], SHAPE[4], SHAPE[2], SHAPE[5], torch.float32, torch.device("cpu"), shared=True)
    assert cache.shared_handle is not None and not cache.tensor.any()
    cache.tensor.copy_(torch.arange(cache.tensor.numel(), dtype=torch.float32).view(SHAPE))
    h = cache.shared_handle
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(shape=SHAPE), str(h.pid), str(h.fd), str(h.token)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    n = cache.tensor.numel()
    assert float(out.stdout) == n * (n - 1) / 2
    assert cache.tensor[0, 0, 0, 0, 0, 0] == -1.0


def test_attach_refuses_what_is_not_the_cache():
    tensor, handle = shared_zeros(SHAPE, torch.float32)
    with pytest.raises(KVTransferError, match="is gone"):
        attach(SharedHandle(handle.pid, handle.fd, handle.token + 1), SHAPE, torch.float32)  # a reused fd number
    with pytest.raises(KVTransferError, match="bytes, expected"):
        attach(handle, (1, *SHAPE[1:]), torch.float32)
    with pytest.raises(KVTransferError, match="cannot map"):
        attach(SharedHandle(handle.pid, 10_000, handle.token), SHAPE, torch.float32)
    assert torch.equal(attach(handle, SHAPE, torch.float32), tensor)


def test_an_unshared_cache_has_no_handle():
    assert KVCache(1, 4, 4, 1, 8, torch.float32, torch.device("cpu")).shared_handle is None
    assert host_key()  # Linux: the same host is recognised


@pytest.mark.parametrize("backend", ["kernel", "torch"])
@pytest.mark.parametrize(
    "src_ids,dst_ids", [([0, 1, 2, 3], [4, 5, 6, 7]), ([7, 2, 3, 4, 0], [1, 5, 6, 0, 2]), ([5], [5]), ([], [])]
)
def test_copy_blocks_matches_gather_then_scatter(src_ids, dst_ids, backend):
    ops = cpu_ops(torch.device("cpu"), backend)
    g = torch.Generator().manual_seed(0)
    # Slices as the receiver copies them: a layer range and a head range of whole caches.
    src = torch.randn(4, *SHAPE[1:], generator=g)[1:3, :, 1:3]
    dst = torch.randn(3, *SHAPE[1:], generator=g)[0:2, :, 0:2]
    expected = dst.clone()
    if src_ids:
        expected.index_copy_(3, torch.tensor(dst_ids), src.index_select(3, torch.tensor(src_ids)))
    copy_blocks(src, src_ids, dst, dst_ids, ops)
    assert torch.equal(dst, expected)
    with pytest.raises(ValueError, match="block ids"):
        copy_blocks(src, [0, 1], dst, [0], ops)
    with pytest.raises((RuntimeError, IndexError)):
        copy_blocks(src, [SHAPE[3]], dst, [0], ops)  # out of range: refused, nothing written past the cache


def test_a_reference_copied_after_the_senders_deadline_fails_the_transfer(monkeypatch):
    """The sender keeps its blocks only until its deadline (a timeout from when the reference
    went out): a copy that ends later may hold another request's KV, so the receiver must not
    accept it."""
    hub = InProcessHub()
    src_cache = KVCache(
        SHAPE[0], SHAPE[3], SHAPE[4], SHAPE[2], SHAPE[5], torch.float32, torch.device("cpu"), shared=True
    )
    dst_cache = KVCache(SHAPE[0], SHAPE[3], SHAPE[4], SHAPE[2], SHAPE[5], torch.float32, torch.device("cpu"))
    sender = connected(KVSender(InProcessTransport("p", hub), timeout=0.5), src_cache)
    receiver = connected(KVReceiver(InProcessTransport("d", hub), timeout=5), dst_cache)
    transfer_id = receiver.expect("r", [3, 4], {"p": sender.address()})
    sender.add("r", [KVTarget("d", receiver.address(), transfer_id, [3, 4], (0, SHAPE[0]), (0, SHAPE[2]))])
    # The copy ends a second after it does: past the 0.5 s the sender holds its blocks.
    late = SimpleNamespace(monotonic=time.monotonic, monotonic_ns=lambda: time.monotonic_ns() + 10**9)
    monkeypatch.setattr("disagg.kv_transfer.receiver.time", late)
    chunk = SimpleNamespace(
        request=SimpleNamespace(request_id="r", block_ids=[1, 2]),
        start=0,
        num_new_tokens=2 * SHAPE[4],
        samples=True,
        generates=False,
    )
    for layer in range(SHAPE[0]):
        sender.save_kv_layer(layer, [chunk])
    sender.forward_done([chunk])
    sender.finish("r", first_token=1)
    results = []
    deadline = time.monotonic() + 10
    while not results and time.monotonic() < deadline:
        results = receiver.poll()
        time.sleep(0.005)
    assert [(r.ok, "after the sender stopped holding it" in (r.error or "")) for r in results] == [(False, True)], (
        results
    )
    sender.close()
    receiver.close()


def test_queued_references_to_consecutive_layers_merge_into_one_message():
    sender = connected(
        KVSender(InProcessTransport("p", InProcessHub()), timeout=5),
        KVCache(4, 8, 4, 2, 8, torch.float32, torch.device("cpu"), shared=True),
    )

    def ref(layer, blocks=(1, 2), valid_until=100, transfer=1):
        header = Header(MsgType.KV_REF, transfer, layer, 0, len(blocks), 0, 2, num_layers=1)
        return header, BlockRef(1, 2, 3, 4, 2, 8, 0, 0, valid_until, list(blocks)).to_tensor()

    done = (Header(MsgType.DONE, 1, token=5), None)
    queued = [
        ref(0, valid_until=90),
        ref(1),
        ref(2, blocks=(1, 3)),
        ref(3, blocks=(1, 3)),
        ref(3, transfer=2),
        done,
        ref(0),
    ]
    merged = sender.coalesce(queued)
    assert [(h.type, h.transfer_id, h.layer, h.num_layers) for h, _ in merged] == [
        (MsgType.KV_REF, 1, 0, 2),  # layers 0-1 of blocks (1, 2): one message
        (MsgType.KV_REF, 1, 2, 2),  # layers 2-3 of other blocks
        (MsgType.KV_REF, 2, 3, 1),  # another transfer
        (MsgType.DONE, 1, 0, 1),  # order kept: nothing merges across it
        (MsgType.KV_REF, 1, 0, 1),
    ]
    assert BlockRef.from_tensor(merged[0][1]).valid_until_ns == 90, "the earliest guarantee of the merged ones"
    sender.close()


@pytest.mark.parametrize("layers_per_copy", [1, 3, 64])  # one at a time, groups that do not divide 4, all at once
def test_a_reference_is_imported_a_group_of_layers_at_a_time(layers_per_copy, monkeypatch):
    import disagg.kv_transfer.receiver as receiver_module

    layers, blocks, block_size, heads, dim = 4, 8, 4, 3, 5
    layer_bytes = 2 * 2 * heads * block_size * dim * 4  # K and V of the 2 blocks sent, float32
    monkeypatch.setattr(receiver_module, "IMPORT_GROUP_BYTES", layers_per_copy * layer_bytes)
    hub = InProcessHub()
    src_cache = KVCache(layers, blocks, block_size, heads, dim, torch.float32, torch.device("cpu"), shared=True)
    dst_cache = KVCache(layers, blocks, block_size, heads, dim, torch.float32, torch.device("cpu"))
    src_cache.tensor.copy_(torch.randn(src_cache.tensor.shape))
    sender = connected(KVSender(InProcessTransport("p", hub), timeout=30), src_cache)
    receiver = connected(KVReceiver(InProcessTransport("d", hub), timeout=30), dst_cache)
    transfer_id = receiver.expect("r", [6, 3], {"p": sender.address()})
    sender.add("r", [KVTarget("d", receiver.address(), transfer_id, [6, 3], (0, layers), (0, heads))])
    chunk = SimpleNamespace(
        request=SimpleNamespace(request_id="r", block_ids=[1, 5]),
        start=0,
        num_new_tokens=2 * block_size,
        samples=True,
        generates=False,
    )
    for layer in range(layers):
        sender.save_kv_layer(layer, [chunk])
    sender.forward_done([chunk])
    sender.finish("r", first_token=1)
    results, deadline = [], time.monotonic() + 10
    while not results and time.monotonic() < deadline:
        results = receiver.poll()
        time.sleep(0.005)
    assert [r.ok for r in results] == [True]
    for src_block, dst_block in ((1, 6), (5, 3)):
        assert torch.equal(dst_cache.tensor[:, :, :, dst_block], src_cache.tensor[:, :, :, src_block])
    assert not dst_cache.tensor[:, :, :, [0, 1, 2, 4, 5, 7]].any(), "nothing else written"
    sender.close()
    receiver.close()
