"""Prefill side: stream a request's KV, layer by layer and chunk by chunk, to decode workers.

The model runner calls `save_kv_layer` right after each layer of a step has written its KV, so the
packing copy happens while later layers compute and the network send runs on the channel's
thread; small layers are grouped into fewer, larger messages (MIN_MESSAGE_BYTES). After the
last chunk the first token goes out in a DONE message; the blocks may be freed when every target
acknowledged (or the transfer failed/timed out), which `poll()` reports.

When the cache is in shared memory and the target is on this host, nothing is packed: a KV_REF
names the blocks and the receiver copies them out of our cache itself (messages.BlockRef). A
reference costs the same whatever it names, so one goes per step for every layer of the target's
range, and that of a prompt's last chunk waits for the DONE and travels with it (KV_REF_DONE).
On a GPU a reference carries a fence (an IPC event after the kernels that wrote its layers), so
no host waits for the step's kernels before a reference goes out.

Under a sliding window only what the receiver reads goes out: a target's block list starts with
placeholders (block_manager.PLACEHOLDER) for the blocks its window left behind, and those are
never sent; nor are the blocks we released ourselves (a moving request's source keeps decoding
while its KV goes out). The receiver goes on from our state, so what we released is out of its
window too.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from disagg.engine.block_manager import PLACEHOLDER, num_placeholders
from disagg.engine.cuda_sharing import WriteFence
from disagg.engine.step_chunks import PortableChunk, RequestRef
from disagg.errors import KVTransferError
from disagg.kv_transfer.endpoint import KVEndpoint, TransferResult, TransferState
from disagg.kv_transfer.layout import KVTarget
from disagg.kv_transfer.messages import BlockRef, Header, MsgType
from disagg.kv_transfer.transport import Transport


# Consecutive layers are packed into one message until it holds this much KV. A short prompt's
# KV then goes in one or a few messages instead of one per layer (each costs a rendezvous and
# thread hand-offs on both sides); a long prompt's layers still go one by one, each as soon as
# it is computed (Llama-3-8B: 1,024 tokens are 4 MiB per layer).
MIN_MESSAGE_BYTES = 4 << 20
NOT_DUE = 1 << 30  # a layer index past any model's last


@dataclass
class _Outgoing:
    request_id: str
    target: KVTarget
    deadline: float
    started: float = field(default_factory=time.monotonic)
    state: TransferState = TransferState.PENDING
    sent_tokens: int = 0  # positions whose KV went out for every layer
    num_bytes: int = 0
    batch: "_LayerBatch | None" = None  # this step's layers packed so far, not yet sent
    step_layer: int = 0  # the next layer to send in this step (global)
    held: "_HeldRef | None" = None  # the prompt's last reference, which goes with the DONE


@dataclass(frozen=True)
class _HeldRef:
    header: Header
    block_ids: list[int]  # ours
    fence: tuple[int, ...]


@dataclass
class _LayerBatch:
    first_layer: int  # global
    num_layers: int
    payload: torch.Tensor | None  # [layers, 2, heads, blocks, block_size, head_dim]; None: by reference
    filled: int = 0


class KVSender(KVEndpoint):
    def __init__(
        self,
        transport: Transport,
        *,
        timeout: float,
        max_queued_messages: int = 32,
        wake: Callable[[], None] | None = None,
    ):
        """The engine hands it its cache (`register_kv_cache`) when it has allocated it. `wake`:
        see KVEndpoint."""
        super().__init__(transport, timeout, max_queued_messages, wake)
        self._by_request: dict[str, list[_Outgoing]] = {}
        self._by_key: dict[tuple[str, int], _Outgoing] = {}
        # The first layer of this step at which `save_kv_layer` has something to do. Between layers
        # the CPU caches are cold after the layer's GEMMs, so even bookkeeping costs; a batch by
        # reference only has work at its last layer.
        self._next_due_layer = 0
        self._registrations = 0  # bumped by add(): a due layer computed meanwhile is stale
        # Targets handed in from other threads, resolved on the engine thread before the next
        # layer goes out (resolving them on the caller's thread would take the GIL from the step).
        self._deferred: deque[tuple[str, Callable[[], list[KVTarget] | None]]] = deque()
        self._write_fence: WriteFence | None = None  # a CUDA cache's, made with its first reference

    @property
    def saves_layers(self) -> bool:
        return True

    # ---- called by the worker ----------------------------------------------------------------
    def add(self, request_id: str, targets: list[KVTarget]) -> None:
        """Register a request's targets (once: a second call is ignored). Safe from any thread,
        also while the request's step runs: the layers it computed before are sent first."""
        deadline = time.monotonic() + self.timeout
        with self._lock:
            if request_id in self._by_request:
                return
            transfers = [_Outgoing(request_id, t, deadline, sent_tokens=self._unwanted_tokens(t)) for t in targets]
            self._by_request[request_id] = transfers
            for tr in transfers:
                self._by_key[(tr.target.peer_id, tr.target.transfer_id)] = tr
            self._registrations += 1
            self._next_due_layer = 0  # the next layer catches up on what it computed before

    def _unwanted_tokens(self, target: KVTarget) -> int:
        """The positions of the target's leading placeholders: its window left them behind."""
        return num_placeholders(target.block_ids) * self.kv_cache.block_size

    def add_later(self, request_id: str, resolve: Callable[[], list[KVTarget] | None]) -> None:
        """From any thread: `add(request_id, resolve())` on the engine thread, at the next layer of
        a step or `add_deferred()`, whichever comes first (None from `resolve`: nothing to add)."""
        self._deferred.append((request_id, resolve))

    def add_deferred(self) -> None:
        """Engine thread: add the targets handed in by `add_later` so far."""
        while self._deferred:
            request_id, resolve = self._deferred.popleft()
            targets = resolve()
            if targets is not None:
                self.add(request_id, targets)

    def has_transfer(self, request_id: str) -> bool:
        return request_id in self._by_request

    def save_kv_layer(self, local_layer: int, chunks) -> None:
        """Layer `local_layer` of this step is computed; send its new blocks."""
        if self._deferred:  # (checked here: a call per layer costs, see _next_due_layer)
            self.add_deferred()
        layer = local_layer + self.kv_cache.layer_offset
        if layer < self._next_due_layer:
            return  # the layers skipped go out with the due one
        registrations, due = self._registrations, NOT_DUE
        for chunk in chunks:
            for tr in self._by_request.get(chunk.request.request_id, ()):
                if tr.state not in (TransferState.PENDING, TransferState.TRANSFERRING):
                    continue
                if tr.target.layers[0] <= layer < tr.target.layers[1]:
                    # step_layer == layer unless layers were skipped or the targets came mid-step.
                    for missed in range(max(tr.step_layer, tr.target.layers[0]), layer + 1):
                        self._send_layer(tr, chunk, missed)
                    tr.step_layer = layer + 1
                due = min(due, self._due_layer(tr, layer))
        self._next_due_layer = due
        if self._registrations != registrations:  # add() ran meanwhile (another thread)
            self._next_due_layer = 0

    @staticmethod
    def _due_layer(tr: _Outgoing, layer: int) -> int:
        """After `layer`, the next layer of this step at which `tr` has work."""
        first, end = tr.target.layers
        if layer < first:
            return first
        if layer + 1 >= end:
            return NOT_DUE  # its whole range went out this step
        if tr.batch is not None and tr.batch.payload is None:
            return tr.batch.first_layer + tr.batch.num_layers - 1  # a reference: sent whole at its end
        return layer + 1  # packed: copied layer by layer

    def _send_layer(self, tr: _Outgoing, chunk, layer: int) -> None:
        bs = self.kv_cache.block_size
        first, last = tr.sent_tokens // bs, -(-(chunk.start + chunk.num_new_tokens) // bs)
        first = _first_held(chunk.request.block_ids, first, last)
        if first >= last:
            return  # nothing new (a catch-up after every layer had gone out)
        heads = tr.target.heads
        if tr.batch is None:
            tr.batch = self._new_batch(tr, layer, last - first)
        batch = tr.batch
        if batch.payload is not None:
            self.kv_cache.pack_layer(layer, heads, chunk.request.block_ids[first:last], batch.payload[batch.filled])
        batch.filled += 1
        tr.state = TransferState.TRANSFERRING
        if batch.filled < batch.num_layers:
            return
        tr.batch = None
        self._extend_deadline(tr)  # before a reference is made: it is valid until the deadline
        num_bytes = batch.num_layers * self._layer_bytes(tr, last - first)
        tr.num_bytes += num_bytes
        self.num_bytes_total += num_bytes
        kind = MsgType.KV if batch.payload is not None else MsgType.KV_REF
        header = Header(
            kind, tr.target.transfer_id, batch.first_layer, first, last - first, heads[0], heads[1], num_layers=batch.num_layers
        )  # fmt: skip
        if batch.payload is not None:
            self._post(tr, header, batch.payload)
            return
        held = _HeldRef(header, chunk.request.block_ids[first:last], self._fence())
        if chunk.samples and not chunk.generates:  # the prompt's last chunk: finish() follows
            tr.held = held
        else:
            self._post(tr, header, self._block_ref(tr, held))

    def _new_batch(self, tr: _Outgoing, layer: int, num_blocks: int) -> _LayerBatch:
        """By reference: every layer left in the target's range this step (a reference costs the
        same whatever it names). Packed: as many of the next layers as make one message of
        MIN_MESSAGE_BYTES (at least one layer, at most those left in the range)."""
        layers_left = tr.target.layers[1] - layer
        path = self.transport.path_to(tr.target.peer_id)
        if self.kv_cache.shared_handle is not None and path is not None and path.by_reference:
            return _LayerBatch(layer, layers_left, None)
        num_layers = max(1, min(layers_left, -(-MIN_MESSAGE_BYTES // self._layer_bytes(tr, num_blocks))))
        return _LayerBatch(layer, num_layers, self.kv_cache.packing_buffer(num_layers, tr.target.heads, num_blocks))

    def _layer_bytes(self, tr: _Outgoing, num_blocks: int) -> int:
        return self.kv_cache.slice_bytes(1, tr.target.heads, num_blocks)

    def _fence(self) -> tuple[int, ...]:
        """What the receiver's copy waits for: nothing on CPU (the layers are written by now), the
        kernels queued so far on a GPU (those that wrote the layers a reference names)."""
        device = self.kv_cache.tensor.device
        if device.type != "cuda":
            return BlockRef.NO_FENCE
        if self._write_fence is None:
            self._write_fence = WriteFence(device)
        return self._write_fence.record()

    def _block_ref(self, tr: _Outgoing, held: _HeldRef) -> torch.Tensor:
        cache, handle = self.kv_cache, self.kv_cache.shared_handle
        # We hold the blocks at least until the transfer's deadline (it only ever moves later);
        # a millisecond off it covers the float seconds' rounding.
        valid_until_ns = int(tr.deadline * 1e9) - 1_000_000
        return BlockRef(
            handle.pid,
            handle.fd,
            handle.token,
            cache.num_layers,
            cache.num_kv_heads,
            cache.num_blocks,
            cache.layer_offset,
            cache.head_offset,
            valid_until_ns,
            list(held.block_ids),
            held.fence,
        ).to_tensor()

    def catch_up(self, request_id: str, block_ids: list[int], num_tokens: int) -> None:
        """Targets added after `num_tokens` positions were computed: send those now, every layer
        (later chunks stream as usual)."""
        done = [PortableChunk(RequestRef(request_id, list(block_ids)), 0, num_tokens, [], False)]
        self._next_due_layer = 0
        for local_layer in range(self.kv_cache.num_layers):
            self.save_kv_layer(local_layer, done)
        self.forward_done(done)

    def forward_done(self, chunks) -> None:
        """Every layer of this step went out: the chunk's positions are now sent."""
        self._next_due_layer = 0
        for chunk in chunks:
            for tr in self._by_request.get(chunk.request.request_id, ()):
                if tr.step_layer >= tr.target.layers[1]:  # every layer of the range went out
                    tr.sent_tokens = max(tr.sent_tokens, chunk.start + chunk.num_new_tokens)
                tr.step_layer = tr.target.layers[0]  # next step: from the range's first layer
                tr.batch = None  # always sent by now: batches end at the range's last layer

    def step_failed(self, chunks) -> None:
        """A step raised part way: its chunks run again, from their range's first layer (the
        layers that went out are sent again; the receiver's copy of them is overwritten)."""
        self._next_due_layer = 0
        for chunk in chunks:
            for tr in self._by_request.get(chunk.request.request_id, ()):
                tr.step_layer = tr.target.layers[0]
                tr.batch = None
                tr.held = None

    def finish(self, request_id: str, first_token: int) -> None:
        """The prompt is done and its first token sampled: tell every target, then await ACKs."""
        for tr in self._by_request.get(request_id, ()):
            if tr.state in (TransferState.PENDING, TransferState.TRANSFERRING):
                tr.state = TransferState.AWAITING_ACK
                tr.deadline = time.monotonic() + self.timeout
                self._post(tr, *self._done_message(tr, first_token))
                self._channel(tr.target.peer_id, tr.target.peer_address).wake_receiver()

    def _done_message(self, tr: _Outgoing, first_token: int) -> tuple[Header, torch.Tensor | None]:
        """DONE, or the held reference with it in one message."""
        held, tr.held = tr.held, None
        if held is None:
            return Header(MsgType.DONE, tr.target.transfer_id, token=first_token), None
        return replace(held.header, type=MsgType.KV_REF_DONE, token=first_token), self._block_ref(tr, held)

    def send_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Before `finish`: the tokens the KV is of go to every target (a moving request's)."""
        payload = torch.tensor(token_ids, dtype=torch.int64)
        for tr in self._by_request.get(request_id, ()):
            if tr.state in (TransferState.PENDING, TransferState.TRANSFERRING):
                self._post(tr, Header(MsgType.TOKENS, tr.target.transfer_id, num_blocks=len(token_ids)), payload)

    def abort(self, request_id: str) -> None:
        """Give up on a request's transfers (e.g. the request was cancelled, or its step failed).
        A receiver that already got some of the KV is told, so that it frees its blocks now
        rather than at its deadline."""
        with self._lock:
            for tr in self._by_request.get(request_id, ()):
                if tr.state in (TransferState.TRANSFERRING, TransferState.AWAITING_ACK):
                    self._tell_receiver(tr, Header(MsgType.ABORT, tr.target.transfer_id))
                self._fail(tr, "aborted")

    def _tell_receiver(self, tr: _Outgoing, header: Header) -> None:
        """Best effort, without waiting: with its queue full the pair is in trouble anyway."""
        try:
            self._channel(tr.target.peer_id, tr.target.peer_address).post(header, None, timeout=0.0)
        except KVTransferError:
            pass

    def _extend_deadline(self, tr: _Outgoing) -> None:
        """KV computed now gets a whole timeout to go out (and its blocks are held that long): the
        deadline measures lack of progress, not how long the request queued or how long its
        prompt is (a long prefill would outgrow any fixed span)."""
        tr.deadline = max(tr.deadline, time.monotonic() + self.timeout)

    def _post(self, tr: _Outgoing, header: Header, payload: torch.Tensor | None = None) -> None:
        if header.type not in (MsgType.DONE, MsgType.KV_REF_DONE):
            self._extend_deadline(tr)
        try:
            self._channel(tr.target.peer_id, tr.target.peer_address).post(
                header, payload, timeout=max(0.0, tr.deadline - time.monotonic())
            )
        except KVTransferError as exc:
            with self._lock:
                self._fail(tr, str(exc))

    # ---- called by channel threads -------------------------------------------------------------
    def recv_deadline(self, peer_id: str) -> float | None:
        with self._lock:
            waiting = [
                tr.deadline
                for tr in self._by_key.values()
                if tr.target.peer_id == peer_id and tr.state is TransferState.AWAITING_ACK
            ]
        return max(waiting, default=None)  # the latest: see KVReceiver.recv_deadline

    def send_deadline(self, peer_id: str, header: Header) -> float | None:
        if header.type is MsgType.ABORT:  # posted as its transfer ended: small, always worth sending
            return time.monotonic() + self.timeout
        with self._lock:
            tr = self._by_key.get((peer_id, header.transfer_id))
            live = tr is not None and tr.state not in (TransferState.DONE, TransferState.FAILED)
            return tr.deadline if live else None

    def payload_buffer(self, peer_id: str, header: Header) -> torch.Tensor | None:
        return None  # only ACKs come back

    def coalesce(self, messages: list[tuple[Header, torch.Tensor | None]]) -> list[tuple[Header, torch.Tensor | None]]:
        """Queued references to consecutive layers of the same blocks become one KV_REF: when
        layers are computed faster than messages go out, the receiver gets them in fewer."""
        merged = [messages[0]]
        for header, payload in messages[1:]:
            last_header, last_payload = merged[-1]
            if _follows(last_header, header) and torch.equal(last_payload[BlockRef.FIXED :], payload[BlockRef.FIXED :]):
                ref = BlockRef.from_tensor(last_payload)
                valid_until_ns = min(ref.valid_until_ns, BlockRef.from_tensor(payload).valid_until_ns)
                merged[-1] = (
                    replace(last_header, num_layers=last_header.num_layers + header.num_layers),
                    replace(ref, valid_until_ns=valid_until_ns).to_tensor(),
                )
            else:
                merged.append((header, payload))
        return merged

    def on_message(self, peer_id: str, header: Header, payload) -> None:
        with self._lock:
            tr = self._by_key.get((peer_id, header.transfer_id))
            if tr is not None and header.type is MsgType.ACK and tr.state is TransferState.AWAITING_ACK:
                tr.state = TransferState.DONE
                self._settle(tr.request_id)
            elif tr is not None and header.type is MsgType.ABORT:
                self._fail(tr, f"{peer_id} dropped the transfer (cancelled on its side)")

    def on_error(self, peer_id: str, error: Exception) -> None:
        with self._lock:
            for tr in list(self._by_key.values()):
                if tr.target.peer_id == peer_id:
                    self._fail(tr, str(error))

    def _overdue(self, now: float) -> bool:
        return any(tr.state is TransferState.AWAITING_ACK and now > tr.deadline for tr in list(self._by_key.values()))

    # ---- bookkeeping (lock held) ---------------------------------------------------------------
    def _expire(self, now: float) -> None:
        for tr in list(self._by_key.values()):
            if tr.state is TransferState.AWAITING_ACK and now > tr.deadline:
                self._fail(tr, f"no acknowledgement from {tr.target.peer_id} within {self.timeout:.1f}s")

    def _fail(self, tr: _Outgoing, error: str) -> None:
        if tr.state in (TransferState.DONE, TransferState.FAILED):
            return
        tr.state = TransferState.FAILED
        self._settle(tr.request_id, error)

    def _settle(self, request_id: str, error: str | None = None) -> None:
        """Report the request once all its transfers ended; a failure ends it at once."""
        transfers = self._by_request.get(request_id)
        if transfers is None:
            return
        if error is None and any(tr.state is not TransferState.DONE for tr in transfers):
            return
        del self._by_request[request_id]
        for tr in transfers:
            self._by_key.pop((tr.target.peer_id, tr.target.transfer_id), None)
            if tr.state is not TransferState.DONE:
                tr.state = TransferState.FAILED
        started = min((tr.started for tr in transfers), default=time.monotonic())  # none: the targets never came
        num_bytes = sum(tr.num_bytes for tr in transfers)
        self._report(
            TransferResult(
                request_id, error is None, error=error, seconds=time.monotonic() - started, num_bytes=num_bytes
            )
        )


def _first_held(block_ids: list[int], first: int, last: int) -> int:
    """From block `first` on, the first that we hold (ours released before are out of every
    window the receiver reads: it goes on from where we are)."""
    while first < last and block_ids[first] == PLACEHOLDER:
        first += 1
    return first


def _follows(a: Header, b: Header) -> bool:
    """b references the layers right after a's, of the same blocks and heads of one transfer."""
    same = (a.transfer_id, a.first_block, a.num_blocks, a.head_start, a.head_end) == (
        b.transfer_id,
        b.first_block,
        b.num_blocks,
        b.head_start,
        b.head_end,
    )
    return a.type is b.type is MsgType.KV_REF and same and b.layer == a.layer + a.num_layers
