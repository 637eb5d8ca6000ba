"""Bursts of arrivals (disagg.router.arrivals): who waits, until when, and who starts first."""

from __future__ import annotations

import asyncio
import time

from disagg.router.arrivals import Arrivals

TURN_S = 0.01
QUIET_TURNS = 5  # a burst is over after 50 ms without an arrival, at least


def arrivals(**kw) -> Arrivals:
    return Arrivals(**{"start_gap_s": 1.0, "burst_min": 2, "turn_s": TURN_S, "quiet_turns": QUIET_TURNS, **kw})


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_a_request_that_arrives_alone_starts_at_once():
    async def scenario():
        door = arrivals(start_gap_s=0.01)
        door.arrived()
        assert not door.in_burst()
        started = time.monotonic()
        await door.after_burst()
        return time.monotonic() - started

    assert run(scenario()) < TURN_S


def test_arrivals_close_together_wait_until_the_burst_is_quiet():
    async def scenario():
        door = arrivals()
        door.arrived()
        door.arrived()
        assert door.in_burst()
        started = time.monotonic()

        async def more():  # the burst goes on for 0.1 s
            for _ in range(5):
                await asyncio.sleep(0.02)
                door.arrived()

        await asyncio.gather(door.after_burst(), more())
        return time.monotonic() - started

    assert 0.1 + QUIET_TURNS * TURN_S * 0.9 < run(scenario()) < 1.0


def test_those_waiting_start_in_the_order_they_came_one_a_turn():
    async def scenario():
        door, started = arrivals(), []
        door.arrived()
        door.arrived()

        async def request(i: int):
            await door.after_burst()
            started.append(i)
            await asyncio.sleep(0)  # its next step: in the turn after its start
            started.append(f"{i} on")

        await asyncio.gather(*(request(i) for i in range(3)))
        await asyncio.sleep(2 * TURN_S)
        return started, door.in_burst()

    # Each starts a turn after the one before, whose next step has run by then.
    assert run(scenario()) == ([0, "0 on", 1, "1 on", 2, "2 on"], False)


def test_a_held_loop_counts_as_one_turn_however_long():
    """Calls may wait unseen in gRPC's core while the loop is held: the quiet must be seen over turns."""

    async def scenario():
        door = arrivals()
        door.arrived()
        door.arrived()
        await asyncio.sleep(0)  # the keeper begins its first turn
        time.sleep(2 * QUIET_TURNS * TURN_S)  # the loop is held past a quiet spell's time
        await asyncio.sleep(TURN_S)  # a turn or two, no more
        held_through = door.in_burst()
        await door.after_burst()
        await asyncio.sleep(2 * TURN_S)
        return held_through, door.in_burst()

    assert run(scenario()) == (True, False)


def test_a_flood_that_does_not_stop_holds_the_admitted_back_for_max_wait_at_most():
    async def scenario():
        door = arrivals(max_wait_s=0.1)
        stop = asyncio.Event()

        async def flood():
            while not stop.is_set():
                door.arrived()
                await asyncio.sleep(TURN_S / 2)

        flooding = asyncio.create_task(flood())
        await asyncio.sleep(0.02)
        started = time.monotonic()
        await door.after_burst()
        waited = time.monotonic() - started
        still = door.in_burst()
        stop.set()
        await flooding
        await asyncio.sleep(3 * QUIET_TURNS * TURN_S)  # it ends once the flood stops
        return waited, still, door.in_burst()

    waited, still, after = run(scenario())
    assert 0.09 < waited < 0.5 and still and not after


def test_in_a_flood_that_does_not_stop_those_whose_wait_is_up_start_now_and_then():
    async def scenario():
        door = arrivals(max_wait_s=0.05, forced_every_s=0.1)
        stop, started_at = asyncio.Event(), []

        async def flood():
            while not stop.is_set():
                door.arrived()
                await asyncio.sleep(TURN_S / 2)

        async def request():
            await door.after_burst()
            started_at.append(time.monotonic())

        flooding = asyncio.create_task(flood())
        await asyncio.sleep(0.02)
        await asyncio.gather(*(request() for _ in range(3)))
        stop.set()
        await flooding
        return [b - a for a, b in zip(started_at, started_at[1:])]

    assert all(gap > 0.09 for gap in run(scenario()))


def test_a_steady_load_below_the_burst_rate_never_waits():
    """200 requests a second, 5 ms apart: a burst needs 16 within 10 ms, so none waits (a steady
    load must not be held back or paced by what guards against floods)."""

    async def scenario():
        door = Arrivals(turn_s=TURN_S, quiet_turns=QUIET_TURNS)  # the defaults: 16 in 10 ms
        waits = []
        for _ in range(40):
            door.arrived()
            started = time.monotonic()
            await door.after_burst()
            waits.append(time.monotonic() - started)
            await asyncio.sleep(0.005)
        return door.in_burst(), max(waits)

    in_burst, longest = run(scenario())
    assert not in_burst and longest < 0.002


def test_sixteen_arrivals_at_once_are_a_burst():
    async def scenario():
        door = Arrivals(turn_s=TURN_S, quiet_turns=QUIET_TURNS)
        for _ in range(15):
            door.arrived()
        before = door.in_burst()
        door.arrived()
        return before, door.in_burst()

    assert run(scenario()) == (False, True)


def test_arrivals_spaced_out_by_the_work_of_those_before_them_are_a_burst():
    """A flood whose calls gRPC hands over one every few turns, each admitted request starting
    its work (3 ms of the loop) in between, comes 16 in 48 ms: too slow for the rate, but each
    next call comes within a few bare turns of the last. From the second on, the admitted wait
    for the burst, and the refusals are answered before their work."""

    async def scenario():
        door = Arrivals(turn_s=TURN_S, quiet_turns=QUIET_TURNS)  # the defaults: 16 in 10 ms
        started: list[int] = []

        async def admitted(i: int) -> None:
            door.arrived()
            await door.after_burst(probe=True)
            started.append(i)
            time.sleep(0.003)  # its work holds the loop

        async def grpc_hands_over() -> None:
            for i in range(16):
                asyncio.ensure_future(admitted(i))
                for _ in range(3):  # the next call, three turns later
                    await asyncio.sleep(0)

        await grpc_hands_over()
        seen_before_any_start = list(started)
        while len(started) < 16:
            await asyncio.sleep(TURN_S)
        return seen_before_any_start, started

    before, started = run(scenario())
    assert before == [] and started == list(range(16))


def test_a_request_alone_waits_a_few_bare_turns_at_most():
    async def scenario():
        door = Arrivals()
        door.arrived()
        started = time.monotonic()
        await door.after_burst(probe=True)
        return time.monotonic() - started, door.in_burst()

    waited, in_burst = run(scenario())
    assert waited < 0.002 and not in_burst
