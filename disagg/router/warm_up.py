"""One short request through every instance before the server says it is serving.

An instance's first request pays for what happens only once: the router dialling its request
link, the KV channel's pair being set up, the decode worker mapping the prefill worker's cache,
the workers' allocators growing and oneDNN building its kernels for new shapes. So no client's
first request pays it, one request goes through each path first (SGLang warms up likewise).

The warm-up goes through the orchestrator, not gRPC: it is not a client's request, so it shows
in no metric and no request record.
"""

from __future__ import annotations

import asyncio
import logging

from disagg.config import ServingConfig
from disagg.placement.policies import LeastOutstandingWork
from disagg.request import SamplingParams
from disagg.router.directory import Instance, InstanceDirectory
from disagg.router.orchestrator import Orchestrator
from disagg.router.streams import DecodeStreams

logger = logging.getLogger(__name__)
PROMPT_TOKENS = 64  # long enough for full KV blocks and a real prefill GEMM


class Pinned(LeastOutstandingWork):
    """A placement policy that always answers the same two instances (and admits everything)."""

    def __init__(self, prefill: Instance | None, decode: Instance):
        self.prefill, self.decode = prefill, decode

    def choose_prefill(self, instances: list[Instance], num_prompt_tokens: int) -> Instance | None:
        return self.prefill

    def choose_decode(self, instances: list[Instance], num_blocks_needed: int) -> Instance | None:
        return self.decode


def placements(config: ServingConfig, directory: InstanceDirectory) -> list[tuple[Instance | None, Instance]]:
    """(prefill, decode) pairs that use every healthy instance at least once; (None, instance)
    for each colocated one."""
    if config.mode == "colocated":
        return [(None, inst) for inst in directory.healthy("colocated")]
    prefill, decode = directory.healthy("prefill"), directory.healthy("decode")
    if not prefill or not decode:
        return []
    return [(prefill[i % len(prefill)], decode[i % len(decode)]) for i in range(max(len(prefill), len(decode)))]


def token_ids(vocab_size: int, length: int = PROMPT_TOKENS, salt: int = 0) -> list[int]:
    """Ordinary (non-special) token ids, spread over the vocabulary; another `salt`, another
    first token (no shared prefix, nothing cached)."""
    low = min(1000, vocab_size // 2)
    return [low + (i * 7919 + salt * 104729) % (vocab_size - low) for i in range(length)]


async def warm_up(
    config: ServingConfig, directory: InstanceDirectory, streams: DecodeStreams, vocab_size: int
) -> list[tuple[str, str]]:
    """Runs the pairs one after the other; returns the (prefill, decode) instance ids that served
    theirs ("" for no prefill). A failure is logged, not raised: health checks decide whether an
    instance gets requests, and its first request then is merely slower."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # a prefill and a decode step
    served = []
    for index, (prefill, decode) in enumerate(placements(config, directory)):
        orchestrator = Orchestrator(config, directory, Pinned(prefill, decode), streams, config.engine.block_size)
        names = (prefill.instance_id if prefill else "", decode.instance_id)
        try:
            await asyncio.wait_for(
                run_request(orchestrator, f"warm-up-{index}", token_ids(vocab_size), params), config.warm_up_timeout_s
            )
            served.append(names)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            logger.warning(
                "warm-up through %s failed: %s: %s", " -> ".join(n for n in names if n), type(exc).__name__, exc
            )
    return served


async def run_request(
    orchestrator: Orchestrator, request_id: str, prompt_token_ids: list[int], params: SamplingParams
) -> None:
    async for _ in orchestrator.generate(request_id, prompt_token_ids, params):
        pass
