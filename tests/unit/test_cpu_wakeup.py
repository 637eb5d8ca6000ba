"""The PM QoS hold (disagg.cpu_wakeup): what it writes, and that a machine without the device
(or without the right to open it) still serves. A plain file stands in for /dev/cpu_dma_latency,
which takes the same 4-byte write."""

from __future__ import annotations

import logging
import struct

import pytest

from disagg.cpu_wakeup import CpuWakeupLatency


def test_writes_the_bound_and_holds_it_until_released(tmp_path):
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    hold = CpuWakeupLatency(20, device=str(device))
    assert hold.held
    assert struct.unpack("i", device.read_bytes()) == (20,)
    hold.release()
    assert not hold.held
    hold.release()  # twice is fine (shutdown paths may overlap)


def test_off_by_default_and_never_fatal(tmp_path, caplog):
    assert not CpuWakeupLatency(None, device=str(tmp_path / "untouched")).held
    assert not (tmp_path / "untouched").exists()
    with caplog.at_level(logging.WARNING, logger="disagg.cpu_wakeup"):
        hold = CpuWakeupLatency(0, device=str(tmp_path / "no" / "such" / "device"))
    assert not hold.held
    assert "cannot bound CPU wake-up latency" in caplog.text


def test_a_negative_bound_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cpu_wakeup_latency_us"):
        CpuWakeupLatency(-5, device=str(tmp_path / "x"))
