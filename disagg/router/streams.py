"""Token streams from decode (or colocated) instances to the requests waiting on them.

Each instance's worker sends one frame per engine step over the router's request link
(disagg.rpc) with the new tokens of every request of this router; the link's reader hands
them here, on the event loop, and each request gets its delta through a mailbox. A mailbox
holds one merged delta: however slowly a client reads, it holds at most one entry, so
nothing here grows without bound.
"""

from __future__ import annotations

import asyncio

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
    """Every request's mailbox, by instance; the directory, which owns the links, hands each
    link's deltas here (`deliver`) and its loss (`lost`)."""

    def __init__(self):
        self._mailboxes: dict[str, dict[str, Mailbox]] = {}  # instance id -> request id -> mailbox

    def open(self, instance_id: str, request_id: str) -> Mailbox:
        box = self._mailboxes.setdefault(instance_id, {})[request_id] = Mailbox(request_id)
        return box

    def close(self, instance_id: str, request_id: str) -> None:
        boxes = self._mailboxes.get(instance_id)
        if boxes is not None:
            boxes.pop(request_id, None)

    async def stop(self) -> None:
        self._mailboxes.clear()

    def deliver(self, instance_id: str, deltas: list[TokenDelta]) -> None:
        """A step's deltas from `instance_id`, each into its request's mailbox."""
        boxes = self._mailboxes.get(instance_id, {})
        for delta in deltas:
            box = boxes.get(delta.request_id)
            if box is not None:  # else the request ended here already
                box.put(delta)

    def lost(self, instance_id: str) -> None:
        """Its link broke (the worker died): every request streaming from it has failed here."""
        for request_id, box in list(self._mailboxes.get(instance_id, {}).items()):
            box.put(TokenDelta.failed(request_id, f"instance {instance_id} failed"))
