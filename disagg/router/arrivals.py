"""Refusals before work: while requests arrive in a burst, the admitted ones wait for it to end
before their work starts (tokenizing, placement, the calls to the workers), and then start one
a turn of the event loop.

Both frontends share one event loop with that work, and neither sees a new request before the
loop has turned a few times: grpc.aio asks its core for the next call only once the last one's
handler has been scheduled, and aiohttp reads a connection's request in a task of its own. A turn
in which hundreds of admitted requests start their work is long, so in a flood every request
behind them waited for all of it before its handler ran, even though refusing it at the
in-flight bound takes microseconds (issue 40: 768 clients against a bound of 256 were refused
after 1.0 s at p50, 64 against 16 in 36 ms). Here the cheap answers go first, and the
admitted requests' work comes in small pieces between them.

A burst is `burst_min` arrivals within `start_gap_s` (16 in 10 ms: a rate no steady load of
one frontend reaches, which a flood passes at once), or, over gRPC, another arrival within
`probe_turns` bare turns of the loop after an admitted request that came alone (issue 52): gRPC
hands over a call it holds a few turns after the last, and when each admitted request started its work at
once, that work spaced a flood's arrivals a few ms apart, too far for the rate to show, so that
every refusal waited for all the admitted requests' starts (768 against 256: the first refusal
after 1.0-1.9 s with a stand-in start of 3 ms). aiohttp reads its connections' requests side
by side, so an HTTP flood shows as a burst without it. A request that arrives otherwise starts
at once (over gRPC after those few turns: microseconds on an idle loop), so that outside a burst
nothing waits longer (a steady 200 requests a second is never held back, and never paced). A
burst is over once `quiet_turns` turns of the loop have gone by with no arrival, each a wait of
`turn_s` at least: turns, not time, since under a flood the loop may be held for long, or the
process starved of CPU, and calls may wait unseen in gRPC's core all the while; a turn after
which no call came says that none waits. Then those waiting start in the order they came, one a
turn, so that a turn stays short and a call that arrives meanwhile is answered in a few turns;
an arrival pauses the starts until it is quiet again. In a flood that does not stop, those that
have waited `max_wait_s` start even so, one every `forced_every_s`: a start holds the loop for a
few ms, and starting them one a turn would hand the loop back to their work, and the flood's
refusals to its pace.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

# BURST_MIN arrivals within this are a burst. Wider than a quiet spell, because one admitted
# request's start-up (a few ms of the loop's time) may come between two accepted calls.
START_GAP_S = 0.01
BURST_MIN = 16
# No arrival for this many turns of the loop, each a wait of TURN_S at least: the burst is over.
# gRPC takes 3 or 4 turns to hand the application a call its core holds.
QUIET_TURNS = 6
TURN_S = 0.0005
MAX_WAIT_S = 1.0  # an admitted request's work waits no longer for quiet, however long the burst
FORCED_EVERY_S = 0.005  # then one starts this often at most while the burst lasts
# An admitted request that is not in a burst looks this many bare turns for another arrival first.
PROBE_TURNS = 6


class Arrivals:
    def __init__(
        self,
        start_gap_s: float = START_GAP_S,
        burst_min: int = BURST_MIN,
        quiet_turns: int = QUIET_TURNS,
        turn_s: float = TURN_S,
        max_wait_s: float = MAX_WAIT_S,
        forced_every_s: float = FORCED_EVERY_S,
        probe_turns: int = PROBE_TURNS,
        clock=time.monotonic,
    ):
        self.start_gap_s = start_gap_s
        self.quiet_turns = quiet_turns
        self.turn_s = turn_s
        self.max_wait_s = max_wait_s
        self.forced_every_s = forced_every_s
        self.probe_turns = probe_turns
        self.clock = clock
        self.count = 0  # arrivals so far
        self._recent: deque[float] = deque(maxlen=max(2, burst_min))  # the latest arrivals' times
        # Admitted requests whose work waits, in arrival order: (their turn, when they must start).
        self._waiting: deque[tuple[asyncio.Future, float]] = deque()
        self._keeper: asyncio.Task | None = None  # while a burst lasts or anyone waits

    def arrived(self) -> None:
        """A request arrived (admitted or not): call it first thing, on the event loop."""
        now = self.clock()
        self._recent.append(now)
        full = len(self._recent) == self._recent.maxlen
        in_burst = full and now - self._recent[0] < self.start_gap_s
        self.count += 1
        if in_burst and self._keeper is None:
            self._keeper = asyncio.get_running_loop().create_task(self._keep(), name="arrivals")

    def in_burst(self) -> bool:
        """Whether admitted requests wait now (a burst, or the starts after one)."""
        return self._keeper is not None

    async def after_burst(self, probe: bool = False) -> None:
        """Until this request's turn to start, after the burst under way (if any). `probe`: a
        request handed over one at a time (gRPC's) first looks for another arrival (_alone)."""
        must_start_by = self.clock() + self.max_wait_s  # also its place in the queue: when it came
        if self._keeper is None and (not probe or await self._alone()):
            return
        entry = (asyncio.get_running_loop().create_future(), must_start_by)
        self._enqueue(entry)
        try:
            # The keeper starts everyone; the timeout only guards against its loss.
            await asyncio.wait_for(entry[0], 10 * self.max_wait_s)
        except asyncio.TimeoutError:
            pass
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)

    def _enqueue(self, entry: tuple[asyncio.Future, float]) -> None:
        """In the order they came: one that probed first may queue after those who came later."""
        place = len(self._waiting)
        while place > 0 and self._waiting[place - 1][1] > entry[1]:
            place -= 1
        self._waiting.insert(place, entry)

    async def _alone(self) -> bool:
        """Whether no other request arrives within `probe_turns` bare turns of the loop
        (microseconds on an idle one). One that does is a flood's next call, which gRPC hands
        over a few turns after the last: each start of work between them would space a flood's
        arrivals out until no burst shows, and its refusals would wait for every start."""
        seen = self.count
        for _ in range(self.probe_turns):
            await asyncio.sleep(0)
            if self.count != seen:
                if self._keeper is None:
                    self._keeper = asyncio.get_running_loop().create_task(self._keep(), name="arrivals")
                return False
        return self._keeper is None

    async def _keep(self) -> None:
        """Turn by turn while a burst lasts or anyone waits: start one waiting request a turn once
        it is quiet; while it is not, the oldest one whose wait is up, now and then."""
        seen, quiet_for, forced_at = self.count, 0, float("-inf")
        try:
            while self._waiting or quiet_for < self.quiet_turns:
                await asyncio.sleep(0 if quiet_for >= self.quiet_turns else self.turn_s)
                quiet_for = quiet_for + 1 if self.count == seen else 0
                seen, now = self.count, self.clock()
                if not self._waiting:
                    continue
                if quiet_for >= self.quiet_turns:
                    _release(self._waiting.popleft()[0])
                elif self._waiting[0][1] <= now and now - forced_at >= self.forced_every_s:
                    _release(self._waiting.popleft()[0])
                    forced_at = now
        finally:
            self._keeper = None
            while self._waiting:  # stopped (the loop ends): nobody is left waiting
                _release(self._waiting.popleft()[0])


def _release(turn: asyncio.Future) -> None:
    if not turn.done():
        turn.set_result(None)
