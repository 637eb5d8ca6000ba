"""A step's chunks as plain data, for the other ranks of a multi-worker instance.

Rank 0 schedules; the other ranks run the same step on their shard of the model and need only
what the model runner and the KV sender read of each chunk. These stand-ins have the same
attribute names as `ScheduledChunk` and its `Request`, and pickle small.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestRef:
    request_id: str
    block_ids: list[int]


@dataclass(frozen=True)
class PortableChunk:
    request: RequestRef
    start: int
    num_new_tokens: int
    token_ids: list[int]
    samples: bool
    generates: bool = False


def portable(chunks) -> list[PortableChunk]:
    """Plain copies of a step's chunks (ScheduledChunk or PortableChunk), in the same order."""
    return [
        PortableChunk(
            RequestRef(c.request.request_id, list(c.request.block_ids)),
            c.start,
            c.num_new_tokens,
            list(c.token_ids),
            c.samples,
            c.generates,
        )
        for c in chunks
    ]
