"""Who gets room on the decode side first, when it has none.

A decode instance refuses a reservation while it runs `max_num_seqs` requests or lacks the
blocks, and the router tries again. Each request retrying on its own back-off would hand the
room to whichever woke first: neither first come nor shortest first, whatever the engines'
`scheduling_order` says. So the requests that found no room wait in one line per router, in the
order an engine keeps its own waiting queue (disagg.engine.queue_order: priority, raised by
waiting, then arrival under fcfs or predicted output length under ltr), and only the first of
them tries; when it leaves (placed, failed or given up), the next tries at once. It tries at the
priority its wait has raised it to (`priority_now`), so that the engine, which may suspend a
running request for a more urgent one (disagg.engine.scheduler), weighs the same priority this
line ordered it by.

This is the decode side's admission order in a disaggregated deployment (an engine's own waiting
queue holds only the prompts of a prefill or colocated instance).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from disagg.engine.queue_order import aged_priority, waiting_order

RECHECK_S = 0.5  # a waiting request's place may change with time alone (aging): look again this often


@dataclass(eq=False)
class Waiter:
    """A request in the line, with what queue_order reads of a request."""

    priority: int
    predicted_output_len: int | None
    queued_at: float
    num_output_tokens: int = 0
    seq: int = field(default=0)  # arrival in the line (ties)


class DecodeAdmission:
    def __init__(self, order: str, aging_s: float, clock=time.monotonic):
        self.order, self.aging_s, self.clock = order, aging_s, clock
        self.waiting: list[Waiter] = []
        self._turn = asyncio.Event()  # set (and replaced) whenever the line changes
        self._seq = itertools.count()

    def join(self, priority: int, predicted_output_len: int | None) -> Waiter:
        waiter = Waiter(priority, predicted_output_len, self.clock(), seq=next(self._seq))
        self.waiting.append(waiter)
        return waiter

    def leave(self, waiter: Waiter) -> None:
        if waiter in self.waiting:
            self.waiting.remove(waiter)
            self._changed()

    def priority_now(self, waiter: Waiter) -> int:
        """Its priority raised by its wait in this line (queue_order.aged_priority)."""
        return int(aged_priority(waiter, self.clock(), self.aging_s))

    def ahead_of(self, priority: int, predicted_output_len: int | None) -> int | None:
        """How many of those waiting would go before a request joining now (None: nobody waits,
        so it need not join)."""
        if not self.waiting:
            return None
        now = self.clock()

        def before(waiter: Waiter) -> bool:
            theirs = aged_priority(waiter, now, self.aging_s)
            if theirs != priority:
                return theirs < priority
            if self.order != "ltr" or waiter.predicted_output_len is None:
                return True  # older, of its class
            return predicted_output_len is None or waiter.predicted_output_len <= predicted_output_len

        return sum(before(w) for w in self.waiting)

    def first(self) -> Waiter | None:
        if not self.waiting:
            return None
        return waiting_order(self.waiting, self.clock(), self.order, self.aging_s)[0]

    async def wait_turn(self, waiter: Waiter, deadline: float) -> bool:
        """Until `waiter` is first in line (True), or `deadline` (time.monotonic()) passes (False)."""
        while self.first() is not waiter:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            turn = self._turn
            try:
                await asyncio.wait_for(turn.wait(), timeout=min(left, RECHECK_S))
            except asyncio.TimeoutError:
                pass
        return True

    def _changed(self) -> None:
        self._turn.set()
        self._turn = asyncio.Event()
