"""The one way a control loop runs (re-planning, rebalancing, drains, health, gauges, relaunch
supervision, the instance directory's refresh): a loop that raises, or returns, is logged,
reported to `on_failure(name)` (the server counts it in `disagg:control_loop_failures_total`)
and started again after a short pause. Without this an exception ends a loop's task silently,
and what it kept up to date (health, placement) freezes at its last value.

Every await on a Ray call or a link inside a loop carries its own timeout
(`ServingConfig.control_call_timeout_s`), so that a loop that waits does so for a bounded time
and this supervisor sees the failure.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)
RESTART_DELAY_S = 1.0  # between a loop's failure and its restart: a loop failing at once every time must not spin

FailureCounter = Callable[[str], None]


def not_counted(name: str) -> None:
    """Where nothing counts failures (tests, tools): they are logged only."""


async def supervise(
    name: str, run: Callable[[], Awaitable[None]], on_failure: FailureCounter = not_counted,
    restart_delay_s: float = RESTART_DELAY_S,
) -> None:  # fmt: skip
    """Runs `run()` again and again until cancelled: each end of it, by an exception or by a
    return, is logged and counted, and followed by a restart after `restart_delay_s`."""
    while True:
        try:
            await run()
            logger.error("control loop %s returned; starting it again", name)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - whatever ended it, the loop must run on
            logger.exception("control loop %s failed; starting it again in %.1f s", name, restart_delay_s)
        on_failure(name)
        await asyncio.sleep(restart_delay_s)


def supervised_task(
    name: str, run: Callable[[], Awaitable[None]], on_failure: FailureCounter = not_counted
) -> asyncio.Task:
    """supervise() as a task of the running loop, named after the control loop."""
    return asyncio.create_task(supervise(name, run, on_failure), name=name)


def supervise_thread(
    name: str, run: Callable[[], None], stopping: threading.Event, on_failure: FailureCounter = not_counted,
    restart_delay_s: float = RESTART_DELAY_S,
) -> None:  # fmt: skip
    """supervise() for a loop on a thread of its own, until `stopping` is set."""
    while not stopping.is_set():
        try:
            run()
            if stopping.is_set():
                return
            logger.error("control loop %s returned; starting it again", name)
        except Exception:  # noqa: BLE001 - see supervise
            logger.exception("control loop %s failed; starting it again in %.1f s", name, restart_delay_s)
        on_failure(name)
        stopping.wait(restart_delay_s)
