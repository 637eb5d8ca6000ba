"""What a frontend's health checks answer, gRPC's health service and HTTP /health alike: one
verdict, kept by the server's health loop (disagg.server), read by both.

NOT_SERVING (HTTP 503) while a pool has no instance in placement (requests would wait for a
relaunch or fail), or while the deployment's controller has been gone for longer than
`controller_grace_s` (its heartbeat key in the registry lapsed: no relaunch, no re-planning
would follow a failure). The grace lets Ray restart a killed controller without the health
checks flapping; a Redis that does not answer is not the controller gone.
"""

from __future__ import annotations

import time


class HealthVerdict:
    def __init__(self, controller_grace_s: float):
        self.controller_grace_s = controller_grace_s
        self.problem: str | None = None  # why this frontend does not serve; None: it serves
        self._controller_gone_since: float | None = None  # time.monotonic() its key was first missed

    def judge(self, pools_served: bool, controller_alive: bool | None, now: float | None = None) -> str | None:
        """The new verdict from one look at the pools and the controller (None: not known)."""
        self.problem = self._problem(pools_served, controller_alive, time.monotonic() if now is None else now)
        return self.problem

    def _problem(self, pools_served: bool, controller_alive: bool | None, now: float) -> str | None:
        if controller_alive is not None:
            self._controller_gone_since = None if controller_alive else (self._controller_gone_since or now)
        if not pools_served:
            return "a pool has no instance"
        gone = self._controller_gone_since
        if gone is not None and now - gone >= self.controller_grace_s:
            return f"the deployment's controller has been gone for {now - gone:.0f} s"
        return None
