"""Every frontend's arrivals and SLO verdicts, for the re-planner, which runs in the deployment's controller.

With several frontends (ServingConfig.frontends) each sees only the requests sent to it, while
the split must be planned for all of them: a re-planner that saw one frontend's share alone would
plan for 1/N of the traffic. Each frontend hands its arrivals to Redis in batches, off its event
loop (disagg.router.records); the controller's re-planner takes them before each round. Times cross
processes (and nodes) as wall-clock time, each side converting from and to its own monotonic
clock. Each arrival keeps its own SLO and priority, which the re-planner prices it by. Soft
state: a batch lost while Redis is away only makes one round plan on less.
"""

from __future__ import annotations

import time

from disagg.registry import Registry
from disagg.slo import SLO
from disagg.router.records import BatchedWrites

MAX_UNREAD = 16_384  # arrivals kept in Redis until the re-planner takes them (its window keeps 4,096)


def _wall_minus_monotonic() -> float:
    return time.time() - time.monotonic()


class ArrivalFeed(BatchedWrites):
    """On a frontend: what the orchestrator's arrivals are handed to, shared (an ArrivalListener)."""

    def __init__(self, registry: Registry, window_s: float, interval_s: float = 1.0):
        super().__init__(
            lambda batch: registry.push_arrivals(batch, MAX_UNREAD, ttl_s=window_s),
            "shared-arrivals",
            interval_s,
            max_pending=MAX_UNREAD,
        )

    def arrived(self, at: float, prompt_tokens: int, output_tokens: int, slo=None, priority: int = 0) -> None:
        """`at`: time.monotonic() of this process; `slo`: the request's own targets (None: the
        server's), `priority`: the engines' value; the re-planner prices each by its own."""
        targets = (None, None) if slo is None else (slo.ttft_ms, slo.tpot_ms)
        self.add((at + _wall_minus_monotonic(), prompt_tokens, output_tokens, *targets, priority))


class VerdictFeed(BatchedWrites):
    """On a frontend: each request's SLO verdict, shared (the re-planner checks a decision on the
    attainment every frontend measured after it, not on what it sees itself: it serves nothing)."""

    def __init__(self, registry: Registry, window_s: float, interval_s: float = 1.0):
        super().__init__(
            lambda batch: registry.push_verdicts(batch, MAX_UNREAD, ttl_s=window_s),
            "shared-slo-verdicts",
            interval_s,
            max_pending=MAX_UNREAD,
        )

    def judged(self, met: bool) -> None:
        self.add((time.time(), met))


def take_shared_verdicts(registry: Registry) -> list[tuple[float, bool]]:
    """In the controller: the frontends' SLO verdicts not yet taken, at this process's time.monotonic()."""
    offset = _wall_minus_monotonic()
    return [(wall - offset, met) for wall, met in registry.take_verdicts()]


def take_shared_arrivals(registry: Registry) -> list[tuple[float, int, int, SLO | None, int]]:
    """In the controller: the frontends' arrivals not yet taken, at this process's time.monotonic(),
    as (time, prompt tokens, output tokens, the request's SLO or None, priority)."""
    offset = _wall_minus_monotonic()
    return [
        (wall - offset, prompt, output, None if ttft is None else SLO(ttft, tpot), priority)
        for wall, prompt, output, ttft, tpot, priority in registry.take_arrivals()
    ]
