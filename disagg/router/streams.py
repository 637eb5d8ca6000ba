"""Token streams from decode (or colocated) instances to the requests waiting on them.

Each instance's worker sends one frame per engine step over the router's request link
(disagg.rpc) with the new tokens of every request of this router; the link's reader hands
them here, on the event loop, and each request gets its delta through a mailbox. A mailbox
holds one merged delta: however slowly a client reads, it holds at most one entry, so
nothing here grows without bound.
"""

from __future__ import annotations

import asyncio

from disagg.router.directory import Instance
from disagg.rpc.messages import TokenDelta


class Mailbox:
    def __init__(self, request_id: str):
        self.request_id = request_id
        self._pending: TokenDelta | None = None
        self._ready = asyncio.Event()

    def put(self, delta: TokenDelta) -> None:
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.merge(delta)
        self._ready.set()

    def wake(self) -> None:
        """Return from a `get` with nothing (None) if nothing is pending: the reader has news
        elsewhere (a live move's handover)."""
        self._ready.set()

    async def get(self, timeout_s: float) -> TokenDelta | None:
        # Not wait_for: on Python 3.11 it can swallow a cancel that lands as the delta arrives.
        async with asyncio.timeout(timeout_s):
            await self._ready.wait()
        self._ready.clear()
        delta, self._pending = self._pending, None
        return delta


class DecodeStreams:
    def __init__(self, on_lost=lambda instance_id: None):
        self.on_lost = on_lost  # an instance's link broke (the directory takes it out of placement)
        self._mailboxes: dict[str, dict[str, Mailbox]] = {}  # instance id -> request id -> mailbox
        self._hooked: dict[str, object] = {}  # instance id -> the link client that delivers into its mailboxes

    def open(self, instance: Instance, request_id: str) -> Mailbox:
        boxes = self._mailboxes.setdefault(instance.instance_id, {})
        if self._hooked.get(instance.instance_id) is not instance.rpc:  # a new instance, or one back at a new address
            self._hooked[instance.instance_id] = instance.rpc
            instance.rpc.on_event = lambda topic, deltas: self._deliver(boxes, deltas)
            instance.rpc.on_disconnect = lambda: self._lost(instance.instance_id, boxes)
        box = boxes[request_id] = Mailbox(request_id)
        return box

    def close(self, instance_id: str, request_id: str) -> None:
        boxes = self._mailboxes.get(instance_id)
        if boxes is not None:
            boxes.pop(request_id, None)

    async def stop(self) -> None:
        self._mailboxes.clear()
        self._hooked.clear()

    @staticmethod
    def _deliver(boxes: dict[str, Mailbox], deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            box = boxes.get(delta.request_id)
            if box is not None:  # else the request ended here already
                box.put(delta)

    def _lost(self, instance_id: str, boxes: dict[str, Mailbox]) -> None:
        """The link broke (the worker died): every request streaming from it has failed here."""
        self.on_lost(instance_id)
        for request_id, box in list(boxes.items()):
            box.put(TokenDelta.failed(request_id, f"instance {instance_id} failed"))
