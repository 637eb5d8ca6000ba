"""Keep idle CPUs out of deep sleep while a worker serves (Linux PM QoS, /dev/cpu_dma_latency).

A disaggregated worker at low load is idle between requests, and an idle CPU sleeps: measured on
the development VM (2 vCPUs, haltpoll idle driver), a 60-token prefill that starts after its core
idled 1.3 s takes 97 ms, against 85 ms right after other work, or after the same idle gap with
this latency bound at 0 (`loadtest/RESULTS.md`). The price is power: the CPUs poll instead of
sleeping (a VM's vCPUs look busy to its host), so it is off unless the serving config sets
`cpu_wakeup_latency_us`. The kernel keeps the bound while any process holds the file open,
and drops it when the last holder exits, however it exits.
"""

from __future__ import annotations

import logging
import os
import struct

logger = logging.getLogger(__name__)
PM_QOS_DEVICE = "/dev/cpu_dma_latency"


class CpuWakeupLatency:
    """Holds a bound on the CPUs' wake-up latency (microseconds) until `release()`."""

    def __init__(self, max_us: int | None, device: str = PM_QOS_DEVICE):
        self._fd: int | None = None
        if max_us is None:
            return
        if max_us < 0:
            raise ValueError(f"cpu_wakeup_latency_us: must be >= 0, got {max_us}")
        try:
            fd = os.open(device, os.O_WRONLY)
        except OSError as exc:  # not root, or no such device (macOS, containers): serve anyway
            logger.warning("cannot bound CPU wake-up latency (%s: %s); idle CPUs may sleep deeply", device, exc.strerror)
            return
        try:
            os.write(fd, struct.pack("i", max_us))
        except OSError as exc:
            os.close(fd)
            logger.warning("cannot bound CPU wake-up latency (%s: %s)", device, exc.strerror)
            return
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
