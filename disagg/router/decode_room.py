"""How long a request is predicted to wait for room on the decode side: part of its TTFT.

While the decode instances have room, nothing: a reservation is answered at once. Once they are
full, a request waits in the router's line (disagg.router.decode_admission) behind those that go
before it, and a place frees each time a request leaves a decode instance. So the wait is the
number ahead of it, plus one, over the rate at which places have freed of late (Little's law
on the line). The step models predict none of this, and it is what grows without bound at
saturation, so without it the goodput policy admits, at the SLO's expense, what it should shed.

A request that may take a running one's place (a better priority: disagg.engine.queue_order)
counts only those of its class ahead of it. No rate measured yet (nothing has left a decode
instance within the window): no prediction, as a guessed model refuses nothing.
"""

from __future__ import annotations

import time
from collections import deque

from disagg.router.decode_admission import DecodeAdmission

WINDOW_S = 30.0  # the rate of freed places is measured over this much of the recent past
MAX_REMEMBERED = 4096  # frees kept for the rate (bounded whatever the rate)


class DecodeRoom:
    def __init__(self, admission: DecodeAdmission, clock=time.monotonic):
        self.admission = admission
        self.clock = clock
        self._frees: deque[float] = deque(maxlen=MAX_REMEMBERED)

    def freed(self) -> None:
        """A request left a decode instance (finished, failed or moved away)."""
        self._frees.append(self.clock())

    def frees_per_s(self) -> float:
        now = self.clock()
        while self._frees and self._frees[0] < now - WINDOW_S:
            self._frees.popleft()
        return len(self._frees) / WINDOW_S

    def wait_ms(self, priority: int, predicted_output_len: int | None) -> float:
        """The predicted wait of a request arriving now (0 while nobody waits)."""
        ahead = self.admission.ahead_of(priority, predicted_output_len)
        rate = self.frees_per_s()
        if ahead is None or rate <= 0:
            return 0.0
        return (ahead + 1) / rate * 1e3
