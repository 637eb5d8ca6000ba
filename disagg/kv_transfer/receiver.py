"""Decode side: receive KV into blocks pre-allocated for a request, then hand it to decode.

`expect()` registers a transfer (the handshake's answer carries its id and block ids) and
starts receiving from each source rank. Payloads are scattered into the blocks as they arrive;
each source's DONE is acknowledged; when every source is done, `poll()` reports the request
with its first token. Received messages go to an importer thread through a small FIFO, so the
next recv is posted while the previous payload is copied into its blocks (gloo's send waits
for the matching recv: without this the sender would idle through every copy). DONE travels
through the same FIFO, so it is acknowledged only after every payload before it is in place. A cancelled transfer's late payloads are dropped, never written, since
its blocks may already belong to someone else.

Under a sliding window a transfer's block list starts with placeholders (the blocks the window
left behind, block_manager.PLACEHOLDER): the sender never sends them, and a message that would
write one fails the transfer.

A KV_REF (a sender on this host with its cache in shared memory) is imported by mapping the
sender's cache once per peer and copying the named blocks straight into ours: one copy in all.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from disagg.engine.block_manager import num_placeholders
from disagg.engine.layers.cpu_kernels import cpu_ops
from disagg.errors import KVTransferError
from disagg.kv_transfer.endpoint import KVEndpoint, TransferResult, TransferState
from disagg.kv_transfer.copy_stream import CopyStream
from disagg.kv_transfer.messages import REFERENCES, BlockRef, Header, MsgType
from disagg.kv_transfer.shared_memory import SharedHandle, attach
from disagg.kv_transfer.transport import Transport


IMPORT_QUEUE_DEPTH = 4  # received messages waiting to be copied into blocks
# A KV_REF's layers are copied this many bytes at a time under the lock: a cancel waits for one
# such copy at most, and a short prompt's 30 layers take one or a few passes instead of one
# Python iteration each, which cost the import thread milliseconds per request.
IMPORT_GROUP_BYTES = 4 << 20


@dataclass
class _Incoming:
    request_id: str
    transfer_id: int
    block_ids: torch.Tensor
    sources: dict[str, str]  # peer id -> address, of sources whose DONE has not come yet
    deadline: float
    started: float = field(default_factory=time.monotonic)
    state: TransferState = TransferState.PENDING
    first_token: int = -1
    num_bytes: int = 0
    first_byte_at: float | None = None
    token_ids: list[int] | None = None  # a moving request's tokens (MsgType.TOKENS)
    num_placeholders: int = 0  # leading entries of block_ids that are no block (out of the window)


class KVReceiver(KVEndpoint):
    def __init__(
        self,
        transport: Transport,
        *,
        timeout: float,
        attention_backend: str = "auto",
        max_queued_messages: int = 32,
        wake: Callable[[], None] | None = None,
    ):
        """The engine hands it its cache (`register_kv_cache`) when it has allocated it.
        `attention_backend` (EngineConfig's): whether the block copy may use the C++ kernel.
        `wake`: see KVEndpoint."""
        super().__init__(transport, timeout, max_queued_messages, wake)
        self.attention_backend = attention_backend
        self._copy_ops = None  # the C++ block copy for the cache's device, or None: torch
        self._copy_stream: CopyStream | None = None  # where copies out of peers' caches run
        self._ids = itertools.count(1)
        self._transfers: dict[int, _Incoming] = {}  # by transfer id: a request's record is its role's
        self._peer_caches: dict[str, tuple[SharedHandle, torch.Tensor]] = {}  # senders' shared caches, mapped
        self._imports: queue.Queue = queue.Queue(maxsize=IMPORT_QUEUE_DEPTH)
        self._importer = threading.Thread(target=self._import_loop, name="kv-import", daemon=True)
        self._importer.start()

    def register_kv_cache(self, kv_cache) -> None:
        super().register_kv_cache(kv_cache)
        self._copy_ops = cpu_ops(kv_cache.tensor.device, self.attention_backend)
        self._copy_stream = CopyStream(kv_cache.tensor.device)

    # ---- called by the worker ----------------------------------------------------------------
    def expect(
        self, request_id: str, block_ids: list[int], sources: dict[str, str], timeout: float | None = None
    ) -> int:
        """Register a transfer into `block_ids` from `sources` (peer id -> address); returns its id.
        Its first bytes must arrive within `timeout` seconds (default: the receiver's), and each
        later arrival within the receiver's timeout of the one before: a deadline of progress, so
        a long prompt whose KV keeps coming is never cut off by a fixed span."""
        with self._lock:
            transfer_id = next(self._ids)
            index = torch.as_tensor(block_ids, dtype=torch.long, device=self.kv_cache.tensor.device)
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            self._transfers[transfer_id] = _Incoming(
                request_id, transfer_id, index, dict(sources), deadline, num_placeholders=num_placeholders(block_ids)
            )
        for peer_id, address in sources.items():
            self._channel(peer_id, address).wake_receiver()
        return transfer_id

    def abort(self, request_id: str) -> None:
        """Stop writing into the request's blocks (call before freeing them)."""
        with self._lock:
            # A handful of transfers are in flight at once: a scan, not an index by request.
            for tr in [t for t in self._transfers.values() if t.request_id == request_id]:
                del self._transfers[tr.transfer_id]
                tr.state = TransferState.FAILED

    # ---- called by channel threads -------------------------------------------------------------
    def recv_deadline(self, peer_id: str) -> float | None:
        with self._lock:
            # The latest deadline, not the nearest: a recv that times out breaks the whole pair, so
            # one stale transfer must not cut short the others (poll() expires each on its own).
            return max((tr.deadline for tr in self._transfers.values() if peer_id in tr.sources), default=None)

    def send_deadline(self, peer_id: str, header: Header) -> float | None:
        return time.monotonic() + self.timeout  # ACKs are small and always worth sending

    def payload_buffer(self, peer_id: str, header: Header) -> torch.Tensor | None:
        if header.type in REFERENCES:
            return BlockRef.empty(header.num_blocks)
        if header.type is MsgType.TOKENS:
            return torch.empty(header.num_blocks, dtype=torch.int64)
        if header.type is not MsgType.KV:
            return None
        cache = self.kv_cache
        return torch.empty(
            header.payload_shape(cache.block_size, cache.head_dim), dtype=cache.tensor.dtype, device=cache.tensor.device
        )

    def on_message(self, peer_id: str, header: Header, payload: torch.Tensor | None) -> None:
        if header.type in (MsgType.KV, *REFERENCES):
            self._progressed(header.transfer_id)
        self._imports.put((peer_id, header, payload))  # blocks while the importer is behind (bounded memory)

    def _progressed(self, transfer_id: int) -> None:
        """KV arrived: the transfer's wait starts over. Here, on the channel thread, before its next
        recv takes the deadline (the import comes later, on the importer's thread)."""
        with self._lock:
            tr = self._transfers.get(transfer_id)
            if tr is not None:
                tr.deadline = max(tr.deadline, time.monotonic() + self.timeout)

    def _import_loop(self) -> None:
        while (item := self._imports.get()) is not None:
            self._handle(*item)

    def close(self) -> None:
        self._imports.put(None)
        super().close()

    def _handle(self, peer_id: str, header: Header, payload: torch.Tensor | None) -> None:
        if header.type in REFERENCES:
            self._import_ref(peer_id, header, BlockRef.from_tensor(payload))
            if header.type is MsgType.KV_REF:
                return  # (KV_REF_DONE: its DONE next, the same way as a DONE of its own)
        ack = None
        with self._lock:
            tr = self._transfers.get(header.transfer_id)
            if tr is None or peer_id not in tr.sources:
                if header.type in (MsgType.DONE, MsgType.KV_REF_DONE):
                    # Cancelled here (or its copy failed): the sender may free its blocks now, not at its timeout.
                    self._reply_to(peer_id, Header(MsgType.ABORT, header.transfer_id))
                return  # cancelled or unknown: drop it
            if header.type is MsgType.KV:
                self._import(tr, header, payload)
            elif header.type is MsgType.TOKENS:
                tr.token_ids = payload.tolist()
            elif header.type in (MsgType.DONE, MsgType.KV_REF_DONE):
                ack = (tr.sources[peer_id], Header(MsgType.ACK, tr.transfer_id))
                self._source_done(tr, peer_id, header.token)
            elif header.type is MsgType.ABORT:
                self._fail(tr, f"{peer_id} aborted the transfer")
        if ack is not None:  # outside the lock: posting may wait on a full queue
            address, header = ack
            self._channel(peer_id, address).post(header, None, timeout=self.timeout)

    def _reply_to(self, peer_id: str, header: Header) -> None:
        with self._channels_lock:
            channel = self._channels.get(peer_id)  # the one the message came through
        try:
            if channel is not None:
                channel.post(header, None, timeout=0.0)
        except KVTransferError:
            pass  # best effort: with its queue full the pair is in trouble anyway (the sender times out)

    def _import(self, tr: _Incoming, header: Header, payload: torch.Tensor) -> None:
        if _writes_placeholder(tr, header):
            self._fail(tr, "the sender wrote into a block this side does not hold (out of its window)")
            return
        heads = self.kv_cache.blocks_view(header.layer, header.num_layers, (header.head_start, header.head_end))
        heads.index_copy_(3, tr.block_ids[header.first_block : header.first_block + header.num_blocks], payload)
        self._count(tr, payload.numel() * payload.element_size())

    def _import_ref(self, peer_id: str, header: Header, ref: BlockRef) -> None:
        """Copy the referenced blocks a few layers at a time (IMPORT_GROUP_BYTES) under the lock: a
        cancel (after which the blocks may be handed to another request) waits for one group's
        copy at most, and so does the engine thread's poll(), however many layers the message covers."""
        with self._lock:
            tr = self._transfers.get(header.transfer_id)
            if tr is None or peer_id not in tr.sources:
                return  # cancelled or unknown: drop it
            if _writes_placeholder(tr, header):
                self._fail(tr, "the sender wrote into a block this side does not hold (out of its window)")
                return
            try:
                source = self._peer_cache(peer_id, ref)
            except KVTransferError as exc:
                self._fail(tr, str(exc))
                return
        src_layer = header.layer - ref.layer_offset
        src_heads = slice(header.head_start - ref.head_offset, header.head_end - ref.head_offset)
        heads = (header.head_start, header.head_end)
        dst_ids = tr.block_ids[header.first_block : header.first_block + header.num_blocks].tolist()
        block_bytes = self.kv_cache.slice_bytes(1, heads, 1)
        group = max(1, IMPORT_GROUP_BYTES // max(1, len(dst_ids) * block_bytes))
        for i in range(0, header.num_layers, group):
            n = min(group, header.num_layers - i)
            with self._lock, self._copy_stream.after(peer_id, ref.fence, source.device):
                if self._transfers.get(header.transfer_id) is not tr:
                    return  # cancelled or failed meanwhile: its blocks are no longer ours to write
                copy_blocks(
                    source[src_layer + i : src_layer + i + n, :, src_heads],
                    ref.block_ids,
                    self.kv_cache.blocks_view(header.layer + i, n, heads),
                    dst_ids,
                    self._copy_ops,
                )
        self._copy_stream.wait()
        with self._lock:
            if self._transfers.get(header.transfer_id) is not tr:
                return
            if time.monotonic_ns() >= ref.valid_until_ns:
                # The sender may have freed its blocks (and reused them) before our copy ended.
                self._fail(tr, f"KV of {peer_id} was copied after the sender stopped holding it")
                return
            self._count(tr, header.num_layers * len(dst_ids) * block_bytes)

    def _peer_cache(self, peer_id: str, ref: BlockRef) -> torch.Tensor:
        """The sender's shared cache, mapped on first use (again if the peer's cache changed)."""
        handle = SharedHandle(ref.pid, ref.fd, ref.token)
        mapped = self._peer_caches.get(peer_id)
        if mapped is None or mapped[0] != handle:
            shape = (ref.num_layers, 2, ref.num_heads, ref.num_blocks, self.kv_cache.block_size, self.kv_cache.head_dim)
            mapped = self._peer_caches[peer_id] = (handle, attach(handle, shape, self.kv_cache.tensor.dtype))
        return mapped[1]

    def _count(self, tr: _Incoming, num_bytes: int) -> None:
        tr.state = TransferState.TRANSFERRING
        tr.first_byte_at = tr.first_byte_at or time.monotonic()
        tr.num_bytes += num_bytes
        self.num_bytes_total += num_bytes

    def _source_done(self, tr: _Incoming, peer_id: str, token: int) -> None:
        del tr.sources[peer_id]
        if token >= 0:
            tr.first_token = token
        if not tr.sources:
            tr.state = TransferState.DONE
            self._finish(tr)

    def on_error(self, peer_id: str, error: Exception) -> None:
        with self._lock:
            self._peer_caches.pop(peer_id, None)  # a peer that died: let its memory go
            if self._copy_stream is not None:
                self._copy_stream.forget(peer_id)
            for tr in list(self._transfers.values()):
                if peer_id in tr.sources:
                    self._fail(tr, f"{peer_id}: {error}")

    def _overdue(self, now: float) -> bool:
        return any(now > tr.deadline for tr in list(self._transfers.values()))

    # ---- bookkeeping (lock held) ---------------------------------------------------------------
    def _expire(self, now: float) -> None:
        for tr in list(self._transfers.values()):
            if now > tr.deadline:
                waited = "no KV arrived" if tr.first_byte_at is None else "the KV stopped arriving"
                self._fail(tr, f"{waited} within the deadline ({now - tr.started:.1f}s after the handshake)")

    def _fail(self, tr: _Incoming, error: str) -> None:
        tr.state = TransferState.FAILED
        self._finish(tr, error)

    def _finish(self, tr: _Incoming, error: str | None = None) -> None:
        self._transfers.pop(tr.transfer_id, None)
        # Transfer time runs from the first byte: time spent waiting for the prefill is not the network's.
        self._report(
            TransferResult(
                tr.request_id,
                error is None,
                tr.first_token,
                error,
                time.monotonic() - (tr.first_byte_at or tr.started),
                tr.num_bytes,
                tr.token_ids,
            )
        )


def _writes_placeholder(tr: _Incoming, header: Header) -> bool:
    """Whether the message's blocks reach into the transfer's leading placeholders."""
    return header.num_blocks > 0 and header.first_block < tr.num_placeholders


def copy_blocks(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int], ops=None) -> None:
    """dst's blocks dst_ids[i] = src's blocks src_ids[i] (dim 3 of [n, 2, heads, blocks, bs, D])
    in one pass over the bytes: the C++ kernel (`ops`: cpu_kernels.cpu_ops), else one strided
    copy per run of blocks that are consecutive on both sides (an index_select then index_copy_
    would copy everything twice). On a GPU the copy is two kernels, a gather and a scatter: there a
    kernel launch costs more than moving a block twice, and scattered blocks make one run each."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"block ids: {len(src_ids)} source blocks for {len(dst_ids)} destination blocks")
    if ops is not None:
        ops.copy_blocks(src, torch.tensor(src_ids, dtype=torch.long), dst, torch.tensor(dst_ids, dtype=torch.long))
        return
    if dst.device.type == "cuda" and src_ids:
        src_index = torch.tensor(src_ids, dtype=torch.long).to(src.device, non_blocking=True)
        dst_index = torch.tensor(dst_ids, dtype=torch.long).to(dst.device, non_blocking=True)
        dst.index_copy_(3, dst_index, src.index_select(3, src_index).to(dst.device))
        return
    start = 0
    for i in range(1, len(src_ids) + 1):
        if i == len(src_ids) or src_ids[i] != src_ids[i - 1] + 1 or dst_ids[i] != dst_ids[i - 1] + 1:
            n = i - start
            dst.narrow(3, dst_ids[start], n).copy_(src.narrow(3, src_ids[start], n))
            start = i
