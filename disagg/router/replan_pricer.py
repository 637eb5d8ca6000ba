"""The re-planner's simulations, off the serving process's hot path (issue 53, item 1).

A round's simulations are seconds of pure Python: in the frontend's process they would hold its
GIL against the event loop that streams tokens. They run in one worker process of their own
(spawned, so that it inherits none of the server's threads or sockets). The queue is bounded at
one round: a round that finds the previous one still pricing is skipped, not queued. Every wait
has a timeout; a worker that overruns it is killed and the next round starts a fresh one.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

logger = logging.getLogger(__name__)


class PricingBusy(Exception):
    """The previous round is still pricing: this one is skipped."""


class PricingPool:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._pool: ProcessPoolExecutor | None = None
        self._busy = False

    async def run(self, fn: Callable, *args):
        """`fn(*args)` in the worker process; PricingBusy while a call is under way,
        TimeoutError past `timeout_s` (the worker is killed then)."""
        if self._busy:
            raise PricingBusy("the previous round is still pricing")
        self._busy = True
        try:
            future = asyncio.wrap_future(self._executor().submit(fn, *args))
            return await asyncio.wait_for(future, self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError, BrokenProcessPool):
            self.close()
            raise
        finally:
            self._busy = False

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return self._pool

    def close(self) -> None:
        """Stops the worker at once (a stuck simulation included)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        workers = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for worker in workers:  # shutdown waits for no call under way: end the process itself
            worker.kill()
            worker.join(timeout=5.0)
