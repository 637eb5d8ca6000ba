"""In what order an engine serves its requests: the waiting queue, the running batch under the
token budget, and which running request it preempts when blocks run out. Pure: no clock of its
own, no torch.

A request's priority (`Request.priority`, vLLM's convention: lower is earlier; critical -1,
standard 0, sheddable 1) comes first everywhere. Within a priority, `scheduling_order` decides:

- fcfs: by arrival in the queue (a preempted request goes back to its front, as before).
- ltr: shortest predicted remaining output first (`Request.predicted_output_len`, set by a
  ranker: issue 39, "Efficient LLM Scheduling by Learning to Rank"); requests with no
  prediction after those with one, by arrival.

The starvation bound: a waiting request rises one priority class per `aging_s` it has waited.
So a request is ahead of any that came more than (their priority gap + 1) * aging_s after it,
however many of those keep coming: a sheddable one is served before critical ones that came
3 * aging_s later (2 * aging_s under fcfs), a long one under ltr before short ones of its class
that came aging_s later. Under fcfs a request rises no higher than the most urgent class
waiting: within a class fcfs is already by age, so rising further would only reorder a class
against itself (and a queue of one class keeps exactly its order).

Displacement: when the batch is full (`max_num_seqs`), a request that waits may take the slot of
a running one it outranks: a better priority, or under ltr the same priority and a predicted
remaining output at most 1 / DISPLACEMENT_RATIO of the other's. The displaced request is
suspended with its KV kept and waits again, aging from then on, so it is back in the batch within
the same bound (a suspended request takes a free slot, or displaces by priority alone). A running request is judged at the priority it got its slot with
(`held_priority`: its own, raised by what it had waited), so one that waited long to get in is not
pushed out again by the next newcomer of its class.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from disagg.config import SCHEDULING_ORDERS
from disagg.request import Request

NO_PREDICTION = math.inf  # what a request without a predicted length counts as: longest
# Under ltr a newcomer displaces a running request of its class only when predicted to need at
# most half the other's remaining output: the ranker's guesses are rough (Kendall's tau ~0.7),
# and a swap on a small difference would cost the batch churn for no expected gain.
DISPLACEMENT_RATIO = 2.0


def check_order(order: str, aging_s: float) -> None:
    if order not in SCHEDULING_ORDERS:
        raise ValueError(f"scheduling_order: must be one of {SCHEDULING_ORDERS}, got {order!r}")
    if not (isinstance(aging_s, (int, float)) and not isinstance(aging_s, bool) and aging_s > 0):
        raise ValueError(f"priority_aging_s: must be a number of seconds > 0, got {aging_s!r}")


def predicted_remaining(request: Request) -> float:
    """Tokens it is predicted still to output; NO_PREDICTION without a prediction."""
    if request.predicted_output_len is None:
        return NO_PREDICTION
    return max(request.predicted_output_len - request.num_output_tokens, 0)


def aged_priority(request: Request, now: float, aging_s: float, ceiling: float = -math.inf) -> float:
    """Its priority, one class better per `aging_s` waited since it was queued, but not better
    than `ceiling`."""
    waited = max(now - request.queued_at, 0.0) if request.queued_at is not None else 0.0
    return max(request.priority - math.floor(waited / aging_s), ceiling)


def held_priority(request: Request) -> float:
    """The priority a running request holds its slot at (its own when it has none recorded)."""
    return request.priority if request.held_priority is None else request.held_priority


def displaces(
    challenger: Request, holder: Request, now: float, order: str, aging_s: float, by_length: bool = True
) -> bool:
    """Whether the waiting `challenger` may take running `holder`'s batch slot (see the module's
    docstring). `by_length=False` (a suspended challenger) leaves only priorities to decide: a
    request suspended for one that waited longer must not push it out again by length."""
    mine, theirs = aged_priority(challenger, now, aging_s), held_priority(holder)
    if mine != theirs:
        return mine < theirs
    if not by_length or order != "ltr" or challenger.predicted_output_len is None:
        return False
    return predicted_remaining(challenger) * DISPLACEMENT_RATIO <= predicted_remaining(holder)


def waiting_order(waiting: Sequence[Request], now: float, order: str, aging_s: float) -> list[Request]:
    """The waiting requests, the next to admit first. `waiting` is in queue order (arrivals at
    the back, preempted requests at the front); a request of a class waits behind the requests
    of better (aged) classes, then by `order`, then by its place in the queue."""
    if not waiting:
        return []
    if order == "fcfs":
        priorities = {r.priority for r in waiting}
        if len(priorities) == 1:
            return list(waiting)  # one class: the queue as it is
        ceiling = min(priorities)
        return sorted(waiting, key=lambda r: aged_priority(r, now, aging_s, ceiling))  # stable: queue order within
    return sorted(waiting, key=lambda r: (aged_priority(r, now, aging_s), predicted_remaining(r)))


def batch_order(running: Iterable[Request]) -> list[Request]:
    """Running requests in the order they get the step's budget and blocks: by priority, then in
    their running order. Preemption takes from the other end (`preemption_victim`)."""
    return sorted(running, key=held_priority)


def preemption_victim(candidates: Sequence[Request], order: str) -> Request | None:
    """The request to preempt (or displace) among `candidates` (in running order): the lowest
    held priority, then under ltr the longest predicted remaining output, then the latest to run
    (its recomputation costs least and the oldest keep making progress)."""
    if not candidates:
        return None

    def preempted_first(indexed: tuple[int, Request]) -> tuple:  # the largest is preempted
        position, request = indexed
        if order == "ltr":
            return held_priority(request), predicted_remaining(request), position
        return held_priority(request), position

    return max(enumerate(candidates), key=preempted_first)[1]
