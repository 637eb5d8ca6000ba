"""SIGTERM as a request to leave: a worker drains (its requests move elsewhere), then exits,
instead of dying with every request on it.

Python runs signal handlers only in a process's main thread. A sync Ray actor's constructor runs
there and installs ours directly. An async actor's (ours) runs elsewhere, and the main thread
belongs to Ray's task loop, whose SIGTERM handler ends the process through
`ray._private.worker.raise_sys_exit_with_custom_error_message`: we put a wrapper in its place
that calls our handler on the first SIGTERM and lets a second one end the process as before.
Where neither applies (another Ray version), SIGTERM keeps its default and `install` says so.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

SIGTERM_MESSAGE = "The process receives a SIGTERM."  # what Ray's handler says (ray._private.worker)


def install(on_first_sigterm: Callable[[], None]) -> bool:
    """Call `on_first_sigterm` on this process's first SIGTERM (a second one exits as before).
    False when it cannot be caught here."""
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _first_then(on_first_sigterm, lambda *args: _call(previous, *args)))
        return True
    try:
        import ray._private.worker as ray_worker

        original = ray_worker.raise_sys_exit_with_custom_error_message
    except (ImportError, AttributeError):
        return False

    def on_exit_request(message, *args, **kwargs):
        if message == SIGTERM_MESSAGE:
            return handler(message, *args, **kwargs)
        return original(message, *args, **kwargs)

    handler = _first_then(on_first_sigterm, lambda *args, **kwargs: original(*args, **kwargs))
    ray_worker.raise_sys_exit_with_custom_error_message = on_exit_request
    return True


def _first_then(first: Callable[[], None], later: Callable) -> Callable:
    told = threading.Event()

    def handle(*args, **kwargs):
        if told.is_set():
            return later(*args, **kwargs)
        told.set()
        first()

    return handle


def _call(previous, signum, frame) -> None:
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
