"""The router's line for room on the decode side (disagg.router.decode_admission): its order
under fcfs and ltr, aging, and the hand-over from one request to the next (pure asyncio)."""

from __future__ import annotations

import asyncio
import time

from disagg.router.decode_admission import DecodeAdmission


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_fcfs_keeps_arrival_and_ltr_puts_the_shortest_predicted_first():
    for order, expected in (("fcfs", [0, 1, 2]), ("ltr", [1, 2, 0])):
        line = DecodeAdmission(order, aging_s=10.0, clock=Clock())
        waiters = [line.join(0, 300), line.join(0, 20), line.join(0, 90)]
        seen = []
        while line.waiting:
            first = line.first()
            seen.append(waiters.index(first))
            line.leave(first)
        assert seen == expected, order


def test_a_critical_request_goes_first_and_a_long_wait_raises_a_request():
    clock = Clock()
    line = DecodeAdmission("ltr", aging_s=10.0, clock=clock)
    old_long = line.join(0, 500)
    clock.now = 5.0
    short = line.join(0, 10)
    critical = line.join(-1, 400)
    assert line.first() is critical
    line.leave(critical)
    assert line.first() is short
    clock.now = 10.5  # the long one has waited one aging period more than the short one
    assert line.first() is old_long


def test_the_next_in_line_tries_as_soon_as_the_first_leaves():
    async def scenario():
        line = DecodeAdmission("ltr", aging_s=10.0)
        first, second = line.join(0, 5), line.join(0, 50)
        deadline = time.monotonic() + 5
        assert await line.wait_turn(first, deadline)
        waiting = asyncio.create_task(line.wait_turn(second, deadline))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # not its turn while the first is in line
        started = time.monotonic()
        line.leave(first)
        assert await waiting
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 0.2  # woken by the leave, not by the periodic look


def test_a_wait_past_its_deadline_gives_up():
    async def scenario():
        line = DecodeAdmission("fcfs", aging_s=10.0)
        line.join(0, None)
        behind = line.join(0, None)
        return await line.wait_turn(behind, time.monotonic() + 0.1)

    assert asyncio.run(scenario()) is False


def test_a_request_tries_at_the_priority_its_wait_raised_it_to():
    """What the router sends the decode engine, which may suspend a running request for it."""
    clock = Clock()
    line = DecodeAdmission("fcfs", aging_s=10.0, clock=clock)
    sheddable = line.join(1, None)
    assert line.priority_now(sheddable) == 1
    clock.now = 25.0
    assert line.priority_now(sheddable) == -1  # two classes up: as urgent as a critical request
