"""Runs an engine's steps on one thread; other threads hand it calls to run between steps.

The engine is not thread-safe, so everything that touches it (adding, aborting, reserving)
is a call that `submit(method, *args)` queues and the loop thread runs before its next step:
the caller names the method, so reading the caller leads to it (vLLM's engine core runs its
clients' requests between steps the same way). When there is nothing to compute the loop
sleeps on a condition until a call arrives or someone `wake()`s it (e.g. a KV transfer
finished: the loop then polls its state), so an idle worker costs nothing and a busy one never
sleeps on a timer.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from disagg.errors import OverloadedError

logger = logging.getLogger(__name__)


class StepLoop:
    def __init__(
        self,
        step: Callable[[], None],
        has_work: Callable[[], bool],
        name: str,
        max_pending_calls: int = 4096,
        idle_timeout: float = 1.0,
        cpus: Iterable[int] | None = None,
    ):
        """`step`: one engine step; `has_work`: whether one is due. `cpus`: the CPUs the loop's thread (and the torch threads it starts) runs on; None: the
        process's (disagg.hosts.cpu_binding says why an engine may want its own)."""
        self._step = step
        self._has_work = has_work
        self._calls: deque[tuple[Callable, tuple, Future]] = deque()
        self._max_pending = max_pending_calls
        self._idle_timeout = idle_timeout  # bounds each idle wait (so stop() is always noticed)
        self._cpus = set(cpus) if cpus is not None else None
        self._cond = threading.Condition()
        self._woken = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.last_error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        """The loop thread's OS id, once started."""
        return self._thread.native_id

    def submit(self, method: Callable, *args) -> Future:
        """Run `method(*args)` on the loop thread before its next step; the Future is its result."""
        future: Future = Future()
        with self._cond:
            if self._stopped:
                future.set_exception(RuntimeError("worker is stopping"))
                return future
            if len(self._calls) >= self._max_pending:
                raise OverloadedError(f"worker call queue is full ({self._max_pending})")
            self._calls.append((method, args, future))
            self._cond.notify()
        return future

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        if self._cpus is not None:
            os.sched_setaffinity(0, self._cpus)
        while True:
            with self._cond:
                while not (self._stopped or self._calls or self._woken or self._has_work()):
                    self._cond.wait(self._idle_timeout)
                if self._stopped:
                    break
                self._woken = False
                calls, self._calls = list(self._calls), deque()
            for method, args, future in calls:
                _apply(method, args, future)
            if self._has_work():
                try:
                    self._step()
                except Exception as exc:  # keep serving the others; the step's requests are reported failed
                    self.last_error = exc
                    logger.exception("engine step failed")
        for _, _, future in self._calls:
            future.set_exception(RuntimeError("worker stopped"))


def _apply(method: Callable, args: tuple, future: Future) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(method(*args))
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        future.set_exception(exc)
