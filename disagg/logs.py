"""Warnings that a stranger can trigger at will (refused links, undecodable requests) are logged
at most once per interval per kind, with a count of those left out: a flood of bad input must not
become a flood of log lines, which would cost the disk and the CPU everyone else needs."""

from __future__ import annotations

import logging
import threading
import time


class ThrottledLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self._logger = logger
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # kind (the format string) -> when it was last logged
        self._left_out: dict[str, int] = {}

    def warning(self, msg: str, *args) -> bool:
        """Log unless `msg` was logged within the interval; True if it was logged."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(msg, -self._interval_s) < self._interval_s:
                self._left_out[msg] = self._left_out.get(msg, 0) + 1
                return False
            self._last[msg] = now
            left_out = self._left_out.pop(msg, 0)
        suffix = f" ({left_out} more like this in the last {self._interval_s:.0f}s not logged)" if left_out else ""
        self._logger.warning(msg + suffix, *args)
        return True
