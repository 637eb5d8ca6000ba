"""Where a request goes: placement policies over any view of the instances' load.

The router runs these on its live `Instance`s, the simulator on its simulated ones: both offer
the `InstanceLoad` attributes, so the simulator exercises the class the server runs, not a copy.

The default, least outstanding work, picks the prefill instance with the fewest prompt tokens
queued and the decode instance with the fewest requests among those with room for the prompt's
blocks. The goodput-aware policy (predicted TTFT/TPOT against the SLO) implements the same interface.
"""

from __future__ import annotations

from typing import Protocol, TypeVar


class InstanceLoad(Protocol):
    instance_id: str

    @property
    def queued_prefill_tokens(self) -> int: ...  # prompt tokens sent and not yet computed

    @property
    def num_requests(self) -> int: ...  # requests running or about to (reserved)

    @property
    def free_blocks(self) -> int: ...


I = TypeVar("I", bound=InstanceLoad)


class PlacementPolicy(Protocol):
    def choose_prefill(self, instances: list[I], num_prompt_tokens: int) -> I | None: ...

    def choose_decode(self, instances: list[I], num_blocks_needed: int) -> I | None: ...


class LeastOutstandingWork:
    def choose_prefill(self, instances: list[I], num_prompt_tokens: int) -> I | None:
        return min(instances, key=lambda i: (i.queued_prefill_tokens, i.instance_id), default=None)

    def choose_decode(self, instances: list[I], num_blocks_needed: int) -> I | None:
        roomy = [i for i in instances if i.free_blocks >= num_blocks_needed]
        return min(roomy or instances, key=lambda i: (i.num_requests, -i.free_blocks, i.instance_id), default=None)
