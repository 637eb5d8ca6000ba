"""Where a request goes: placement policies over any view of the instances' load.

The router runs these on its live `Instance`s, the simulator on its simulated ones: both offer
the `InstanceLoad` attributes, so the simulator exercises the class the server runs, not a copy.

The baseline, least outstanding work, picks the prefill instance with the fewest prompt tokens
queued and the decode instance with the fewest requests among those with room for the prompt's
blocks. The goodput-aware policy (disagg.placement.goodput: predicted TTFT/TPOT against the
request's SLO) implements the same interface.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, TypeVar

from disagg.slo import SLO


class InstanceLoad(Protocol):
    instance_id: str

    @property
    def queued_prefill_tokens(self) -> int: ...  # prompt tokens sent and not yet computed

    @property
    def num_requests(self) -> int: ...  # requests running or about to (reserved)

    @property
    def free_blocks(self) -> int: ...


I = TypeVar("I", bound=InstanceLoad)
PRIORITIES = ("critical", "standard", "sheddable")


@dataclass(frozen=True)
class RequestShape:
    prompt_tokens: int
    max_tokens: int
    slo: SLO
    priority: str = "standard"
    blocks_needed: int = 0  # KV blocks its prompt takes on the decode side
    block_hashes: tuple[int, ...] = ()  # its prompt's chained block hashes (prefix-cache lookups)
    # Tokens it is expected to write (disagg.router.output_lengths); None: max_tokens.
    expected_output_tokens: int | None = None
    # Its predicted wait for room on the decode side (disagg.router.decode_room), added to every
    # disaggregated option's TTFT (a decode instance that prefills it itself has no more room).
    decode_wait_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority: must be one of {PRIORITIES}, got {self.priority!r}")

    @property
    def output_tokens(self) -> int:
        """What its TPOT prediction takes it to write."""
        return self.max_tokens if self.expected_output_tokens is None else self.expected_output_tokens


@dataclass(frozen=True)
class Choice:
    """Where a request goes and what is predicted for it there; `admitted` False: refuse it."""

    prefill: object
    decode: object
    ttft_ms: float
    tpot_ms: float
    headroom: float
    admitted: bool
    cached_tokens: int = 0  # of its prompt, predicted to be in the prefill instance's prefix cache
    local: bool = False  # disaggregated pools, prefilled on the decode instance itself (no KV transfer)
    # The step models' own parts of the predictions (without the instances' residuals): what the
    # residuals learn against, once the request's TTFT and TPOT are measured.
    ttft_model_ms: float = math.nan
    tpot_model_ms: float = math.nan

    def refusal(self, slo: SLO) -> str:
        return (
            f"no instance is predicted to meet the SLO (TTFT {slo.ttft_ms:.0f} ms, TPOT {slo.tpot_ms:.0f} ms): "
            f"best predicted TTFT {self.ttft_ms:.0f} ms, TPOT {self.tpot_ms:.0f} ms"
        )


class PlacementPolicy(Protocol):
    def choose_pair(self, prefills: list[I], decodes: list[I], request: RequestShape) -> Choice | None:
        """Both instances of a request at once (None: a pool is empty). A colocated pool is
        passed as both lists (the same list object): the pair is then one instance."""

    def choose_prefill(self, instances: list[I], num_prompt_tokens: int) -> I | None: ...

    def choose_decode(self, instances: list[I], num_blocks_needed: int) -> I | None: ...


class LeastOutstandingWork:
    def choose_pair(self, prefills: list[I], decodes: list[I], request: RequestShape) -> Choice | None:
        decode = self.choose_decode(decodes, request.blocks_needed)
        prefill = decode if prefills is decodes else self.choose_prefill(prefills, request.prompt_tokens)
        if prefill is None or decode is None:
            return None
        return Choice(prefill, decode, math.nan, math.nan, math.inf, admitted=True)

    def choose_prefill(self, instances: list[I], num_prompt_tokens: int) -> I | None:
        return min(instances, key=lambda i: (i.queued_prefill_tokens, i.instance_id), default=None)

    def choose_decode(self, instances: list[I], num_blocks_needed: int) -> I | None:
        roomy = [i for i in instances if i.free_blocks >= num_blocks_needed]
        return min(roomy or instances, key=lambda i: (i.num_requests, -i.free_blocks, i.instance_id), default=None)
