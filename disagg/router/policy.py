"""Where a request goes: a pluggable placement policy.

The default, least outstanding work, picks the prefill instance with the fewest prompt tokens
queued (its own report plus what the router sent since) and the decode instance with the fewest
requests among those with room for the prompt's blocks. The goodput-aware policy (predicted
TTFT/TPOT against the SLO) implements the same interface.
"""

from __future__ import annotations

from typing import Protocol

from disagg.router.directory import Instance


class PlacementPolicy(Protocol):
    def choose_prefill(self, instances: list[Instance], num_prompt_tokens: int) -> Instance | None: ...

    def choose_decode(self, instances: list[Instance], num_blocks_needed: int) -> Instance | None: ...


class LeastOutstandingWork:
    def choose_prefill(self, instances: list[Instance], num_prompt_tokens: int) -> Instance | None:
        return min(
            instances,
            key=lambda i: (i.view.load.queued_prefill_tokens + i.outstanding_prefill_tokens, i.instance_id),
            default=None,
        )

    def choose_decode(self, instances: list[Instance], num_blocks_needed: int) -> Instance | None:
        roomy = [i for i in instances if i.free_blocks >= num_blocks_needed]
        return min(
            roomy or instances,
            key=lambda i: (i.view.load.num_running + i.outstanding_requests, -i.free_blocks, i.instance_id),
            default=None,
        )
