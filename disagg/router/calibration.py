"""Each instance's latency model measured at start, before the server says it is serving.

The goodput policy predicts from each instance's step model, fitted online from the steps the
instance reports (disagg.placement.online_fit). Until a kind of step has enough samples the
model is a guess, and the router neither refuses nor orders anything on a guess. So that
predictions and SLO admission hold from the first client request on, `disagg serve` first sends
each path a short sweep of its own (unless the config gives a profile): prompts of a range of
lengths one at a time (prefill steps of different sizes), then growing batches decoding
together (decode steps of different batch sizes and contexts); all paths at once, as they serve. The first round only warms up:
a shape's first step builds its kernels (oneDNN) and would teach the model a slowness that does
not last, so the models forget it. Rounds repeat, on fresh prompts, until every instance's
prefill and decode models are fitted or `calibration_s` has passed.

Like the warm-up it goes through the orchestrator with pinned instances, so it shows in no
metric or request record, and it teaches the models only through the workers' step reports.
"""

from __future__ import annotations

import asyncio
import logging
import time

from disagg.config import ServingConfig
from disagg.request import SamplingParams
from disagg.router.directory import Instance, InstanceDirectory
from disagg.router.orchestrator import Orchestrator
from disagg.router.streams import DecodeStreams
from disagg.router.warm_up import Pinned, placements, run_request, token_ids

PROMPT_LENGTHS = (16, 32, 64, 96, 128, 192, 256, 384, 512)  # prefill steps of sizes apart
BATCH_SIZES = (2, 4, 8)  # requests decoding together
DECODE_TOKENS = 12

logger = logging.getLogger(__name__)


async def calibrate(
    config: ServingConfig, directory: InstanceDirectory, streams: DecodeStreams, vocab_size: int, limit_s: float
) -> bool:
    """Runs rounds until every healthy instance is calibrated or `limit_s` has passed; returns
    whether all are. A failed request is logged and the round goes on: health checks decide
    which instances serve, and one left uncalibrated is placed by load until traffic fits it."""
    deadline = time.monotonic() + limit_s
    round_index = 0
    while not _all_calibrated(directory) and time.monotonic() < deadline:
        # Every path's sweep at once: one after another, a round takes the sum of their times, and
        # a slow host's instances past the first were left uncalibrated at the deadline.
        sweeps = [
            _sweep(
                Orchestrator(config, directory, Pinned(prefill, decode), streams, config.engine.block_size),
                config, round_index * 1000 + pair_index * 100, vocab_size, deadline,
            )
            for pair_index, (prefill, decode) in enumerate(placements(config, directory))
        ]  # fmt: skip
        await asyncio.gather(*sweeps)
        await _until_reported(directory, config.heartbeat_interval_s, deadline, wait_all=round_index == 0)
        if round_index == 0:
            for inst in directory.all():
                inst.online.forget()
        round_index += 1
    calibrated = _all_calibrated(directory)
    spent = limit_s - (deadline - time.monotonic())
    for inst in directory.all():
        logger.info("%s model after %d rounds, %.1f s of calibration: %s", inst.instance_id, round_index, spent,
                    inst.online.model)  # fmt: skip
    if not calibrated:
        logger.warning("calibration did not fit every instance in %.0f s; the rest calibrate on traffic", limit_s)
    return calibrated


async def _sweep(orchestrator: Orchestrator, config: ServingConfig, salt: int, vocab_size: int, deadline: float):
    budget = config.pool_engine_config(config.prefill).max_num_batched_tokens
    lengths = [n for n in PROMPT_LENGTHS if n <= budget]
    one_step = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for i, length in enumerate(lengths):
        await _bounded(
            orchestrator, f"calibrate-{salt + i}", token_ids(vocab_size, length, salt + i), one_step, deadline
        )
    decoding = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    for batch in BATCH_SIZES:
        requests = [
            _bounded(orchestrator, f"calibrate-{salt}-{batch}-{j}",
                     token_ids(vocab_size, lengths[j % len(lengths)], salt + 50 + batch * 10 + j), decoding, deadline)
            for j in range(batch)
        ]  # fmt: skip
        await asyncio.gather(*requests)


async def _bounded(orchestrator, request_id: str, prompt: list[int], params: SamplingParams, deadline: float):
    left = deadline - time.monotonic()
    if left <= 0:
        return
    try:
        await asyncio.wait_for(run_request(orchestrator, request_id, prompt, params), left)
    except Exception as exc:  # noqa: BLE001 - see calibrate()
        logger.warning("calibration request %s failed: %s: %s", request_id, type(exc).__name__, exc)


async def _until_reported(directory: InstanceDirectory, interval_s: float, deadline: float, wait_all: bool) -> None:
    """Waits for the workers' next step reports (a heartbeat or two; less once all are
    calibrated, unless `wait_all`), or less at the deadline."""
    wait_until = min(deadline, time.monotonic() + 2 * interval_s)
    while time.monotonic() < wait_until and (wait_all or not _all_calibrated(directory)):
        await asyncio.sleep(0.05)


def _all_calibrated(directory: InstanceDirectory) -> bool:
    return all(_calibrated(inst) for inst in directory.all())  # all(): the healthy ones


def _calibrated(inst: Instance) -> bool:
    if inst.role == "prefill":
        return inst.prefill_calibrated
    if inst.role == "decode":
        return inst.decode_calibrated
    return inst.prefill_calibrated and inst.decode_calibrated
