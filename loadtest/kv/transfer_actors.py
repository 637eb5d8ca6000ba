"""Ray actors that measure raw KV-transfer bandwidth over the configured transport (no protocol on top).

    from loadtest.kv.transfer_actors import measure_raw_bandwidth
    gbps = measure_raw_bandwidth(256 * 2**20, torch.float32, repeats=5)

One contiguous tensor goes from one actor to the other per repeat. The sender times
"send + wait for the receiver's 1-element ack", after a "ready" message from the receiver, so the
time is the receiver's, measured on one clock, and includes no waiting for the receiver to show up.
One unmeasured warm-up transfer comes first. Returns the median, in GB/s (10^9 bytes per second).
"""

from __future__ import annotations

import secrets
import statistics
import sys
import time

import ray
import torch
from ray import cloudpickle

from disagg.config import DEFAULT_KV_TRANSPORT
from disagg.kv_transfer.factory import make_transport

# Ray workers find this module only where they share the driver's working directory (the
# repository root, under `python -m`): ship the actor class by value, whoever imports it.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONNECT_TIMEOUT_S = 60.0


@ray.remote(num_cpus=0)
class KVBenchPeer:
    def __init__(self, worker_id: str, key: bytes, host: str = "127.0.0.1"):
        """`key`: shared by both peers (the deployment's key, disagg.auth)."""
        torch.set_num_threads(1)
        self.transport = make_transport(DEFAULT_KV_TRANSPORT, worker_id, key, host)
        self._flag = torch.zeros(1)

    def address(self) -> str:
        return self.transport.address()

    def connect(self, peer_id: str, address: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.transport.connect(peer_id, address, timeout)

    def send_timed(self, peer_id: str, num_bytes: int, dtype: torch.dtype, repeats: int, timeout: float) -> list[float]:
        """Seconds per transfer (send until acked), for each of `repeats` after one warm-up."""
        element_size = torch.empty((), dtype=dtype).element_size()
        payload = torch.ones(num_bytes // element_size, dtype=dtype)
        seconds = []
        for _ in range(repeats + 1):
            self.transport.recv(peer_id, self._flag, timeout)  # the receiver is about to post its recv
            start = time.perf_counter()
            self.transport.send(peer_id, payload, timeout)
            self.transport.recv(peer_id, self._flag, timeout)  # it has all of it
            seconds.append(time.perf_counter() - start)
        return seconds[1:]

    def recv_acking(self, peer_id: str, num_bytes: int, dtype: torch.dtype, repeats: int, timeout: float) -> bool:
        element_size = torch.empty((), dtype=dtype).element_size()
        out = torch.empty(num_bytes // element_size, dtype=dtype)
        for _ in range(repeats + 1):
            self.transport.send(peer_id, self._flag, timeout)
            self.transport.recv(peer_id, out, timeout)
            self.transport.send(peer_id, self._flag, timeout)
        return bool(out[-1].item() == 1)


def connect_pair(a, a_id: str, b, b_id: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """Both actors connect to each other at once (the transport's rendezvous)."""
    a_addr, b_addr = ray.get([a.address.remote(), b.address.remote()])
    ray.get([a.connect.remote(b_id, b_addr, timeout), b.connect.remote(a_id, a_addr, timeout)], timeout=timeout + 30)


def measure_raw_bandwidth(
    num_bytes: int, dtype: torch.dtype = torch.float32, repeats: int = 5, timeout: float = 120.0
) -> float:
    """Median GB/s of one contiguous `num_bytes` tensor sent between two fresh Ray actors.

    Starts a local Ray (2 CPUs) when none is running, and shuts it down again afterwards.
    """
    if repeats < 1:
        raise ValueError(f"repeats: must be >= 1, got {repeats}")
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    key = secrets.token_bytes(32)
    sender, receiver = KVBenchPeer.remote("bench-sender", key), KVBenchPeer.remote("bench-receiver", key)
    try:
        connect_pair(sender, "bench-sender", receiver, "bench-receiver")
        receiving = receiver.recv_acking.remote("bench-sender", num_bytes, dtype, repeats, timeout)
        seconds = ray.get(sender.send_timed.remote("bench-receiver", num_bytes, dtype, repeats, timeout))
        if not ray.get(receiving):
            raise RuntimeError("the receiver did not get the payload")
    finally:
        for actor in (sender, receiver):
            ray.kill(actor)
        if started_ray:
            ray.shutdown()
    element_size = torch.empty((), dtype=dtype).element_size()
    return (num_bytes // element_size) * element_size / statistics.median(seconds) / 1e9


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="tensor size in MiB (float32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers; the median is printed")
    args = parser.parse_args(argv)
    size = args.mib * 2**20
    gbps = measure_raw_bandwidth(size, torch.float32, args.repeats)
    print(f"raw KV transfer, {args.mib} MiB float32, median of {args.repeats}: {gbps:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
