"""Control loops under disagg.supervision: a loop that raises (or returns) is started again and
counted in `disagg:control_loop_failures_total`; cancelling it ends it."""

from __future__ import annotations

import asyncio
import threading

import pytest
from prometheus_client import generate_latest

from disagg.metrics import ServingMetrics
from disagg.supervision import supervise, supervise_thread


def failing_loop(runs: list, fail_times: int):
    async def run():
        runs.append(len(runs))
        if len(runs) <= fail_times:
            raise RuntimeError(f"round {len(runs)} broke")
        await asyncio.Event().wait()  # then runs until cancelled

    return run


def test_a_loop_that_raises_is_restarted_and_counted():
    metrics, runs = ServingMetrics(), []

    async def main():
        task = asyncio.create_task(
            supervise("replanning", failing_loop(runs, 2), metrics.control_loop_failed, restart_delay_s=0.01)
        )
        while len(runs) < 3:
            await asyncio.sleep(0.01)
        assert not task.done(), "the third start runs on"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert runs == [0, 1, 2]
    text = generate_latest(metrics.registry).decode()
    assert 'disagg:control_loop_failures_total{loop="replanning"} 2.0' in text


def test_a_loop_that_returns_is_restarted_too():
    failures, runs = [], []

    async def returns():
        runs.append(1)

    async def main():
        task = asyncio.create_task(supervise("gauges", returns, failures.append, restart_delay_s=0.01))
        while len(runs) < 3:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    assert failures[:2] == ["gauges", "gauges"]


def test_a_thread_loop_is_restarted_until_stopped():
    failures, runs, stopping = [], [], threading.Event()

    def run():
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("broke")
        stopping.wait()

    thread = threading.Thread(target=supervise_thread, args=("relaunch", run, stopping, failures.append, 0.01))
    thread.start()
    for _ in range(500):
        if len(runs) == 3:
            break
        threading.Event().wait(0.01)
    stopping.set()
    thread.join(5)
    assert not thread.is_alive() and len(runs) == 3 and failures == ["relaunch", "relaunch"]
