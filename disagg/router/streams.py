"""Token streams from decode (or colocated) instances to the requests waiting on them.

One poller task per instance takes that instance's whole outbox per call (`next_outputs`),
so the router makes one remote call per engine step per instance, and hands each request its
delta through a mailbox. A mailbox holds one merged delta: however slowly a client reads, it
holds at most one entry, so nothing here grows without bound.
"""

from __future__ import annotations

import asyncio
import logging

from disagg.router.directory import Instance
from disagg.worker_api import TokenDelta

logger = logging.getLogger(__name__)


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

    async def get(self, timeout_s: float) -> TokenDelta:
        await asyncio.wait_for(self._ready.wait(), timeout_s)
        self._ready.clear()
        delta, self._pending = self._pending, None
        return delta


class DecodeStreams:
    def __init__(self, poll_timeout_s: float = 1.0):
        self.poll_timeout_s = poll_timeout_s
        self._mailboxes: dict[str, dict[str, Mailbox]] = {}  # instance id -> request id -> mailbox
        self._pollers: dict[str, asyncio.Task] = {}

    def open(self, instance: Instance, request_id: str) -> Mailbox:
        box = Mailbox(request_id)
        self._mailboxes.setdefault(instance.instance_id, {})[request_id] = box
        poller = self._pollers.get(instance.instance_id)
        if poller is None or poller.done():
            self._pollers[instance.instance_id] = asyncio.create_task(self._poll(instance), name=f"poll-{instance.instance_id}")
        return box

    def close(self, instance_id: str, request_id: str) -> None:
        boxes = self._mailboxes.get(instance_id)
        if boxes is not None:
            boxes.pop(request_id, None)

    async def stop(self) -> None:
        for task in self._pollers.values():
            task.cancel()

    async def _poll(self, instance: Instance) -> None:
        boxes = self._mailboxes[instance.instance_id]
        while boxes:
            try:
                deltas = await instance.actor.next_outputs.remote(self.poll_timeout_s)
            except Exception as exc:  # the actor died: every request on it has failed
                logger.warning("decode instance %s unreachable: %s", instance.instance_id, exc)
                for request_id, box in list(boxes.items()):
                    box.put(TokenDelta(request_id, [], finished=True, finish_reason="abort", error=f"instance {instance.instance_id} failed"))
                return
            for delta in deltas:
                box = boxes.get(delta.request_id)
                if box is not None:
                    box.put(delta)
