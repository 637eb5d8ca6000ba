"""Load levels relative to a capacity measured in the same run.

A fixed request rate means different things on different hosts (1.5 req/s queues a slow host's
decode side and leaves a fast host's idle), so a benchmark measures its deployment's capacity on
its own workload first, briefly, and offers load as a fraction of it (`--load 0.8`), printing
both. The capacity is the rate a closed loop of enough streams to saturate the deployment
completes requests at: the most it sustains on that workload.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from disagg.bench.load_client import LoadRequest, LoadRun, closed_loop


@dataclass(frozen=True)
class Capacity:
    requests_per_s: float  # completed requests per second of the saturated run
    output_tokens_per_s: float
    completed: int
    failed: int
    duration_s: float
    streams: int

    def rate(self, load: float) -> float:
        """Requests per second at `load` (a fraction of this capacity)."""
        return load * self.requests_per_s

    def describe(self, load: float) -> str:
        return (
            f"load {load:g} x capacity {self.requests_per_s:.3f} req/s = {self.rate(load):.3f} req/s "
            f"(capacity: {self.completed} requests at {self.streams} streams in {self.duration_s:.1f} s)"
        )

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def capacity_of(run: LoadRun, streams: int) -> Capacity:
    done = run.completed
    if not done:
        raise RuntimeError(f"capacity: none of {len(run.records)} requests completed ({run.records[0].error})")
    return Capacity(
        len(done) / run.duration_s,
        sum(r.output_len for r in done) / run.duration_s,
        len(done),
        len(run.records) - len(done),
        run.duration_s,
        streams,
    )


async def measure_capacity(api, requests: list[LoadRequest], streams: int) -> Capacity:
    """Every one of `requests` (prompts the measured run does not repeat: a cached prefix would
    flatter it) sent once by `streams` closed-loop clients; its completion rate."""
    return capacity_of(await closed_loop(api, requests, streams), streams)


def add_load_argument(parser: argparse.ArgumentParser, default: float, what: str = "the offered rate") -> None:
    parser.add_argument(
        "--load",
        type=_fraction,
        default=default,
        help=f"{what}, as a fraction of the deployment's capacity measured first in the same run",
    )


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a fraction of the capacity > 0, got {text!r}")
    return value
