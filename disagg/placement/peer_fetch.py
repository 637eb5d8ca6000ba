"""Whether a prefill instance should fetch a prompt's cached prefix from a peer instead of
computing it: pure, the router's rule (disagg.router.peer_fetch) and a test's alike.

The prefill instance chosen for a request holds the prompt's first `own` blocks; another
instance (a decode instance holding a conversation's history, another prefill instance) may hold
more, by the cluster-wide prefix index. Fetching the blocks between the two costs their bytes
over the KV transport plus a fixed latency (the calls that set the fetch up); it saves the
prefill of those tokens, priced by the instance's own step model. A fetch is planned only when
it is predicted faster; anything that goes wrong later costs the recompute it would have been.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from disagg.placement.latency_model import StepModel


class Holder(Protocol):
    instance_id: str

    def cached_tokens(self, block_hashes) -> int:
        """Tokens of the prompt's leading blocks that it holds."""


@dataclass(frozen=True)
class FetchRate:
    """How fast blocks move between two instances: `bytes_per_s` over the KV transport, plus
    `latency_ms` for the round trips that set a fetch up."""

    bytes_per_s: float
    latency_ms: float

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0 or self.latency_ms < 0:
            raise ValueError("peer fetch: bytes_per_s must be > 0 and latency_ms >= 0")

    def transfer_ms(self, num_bytes: int) -> float:
        return self.latency_ms + num_bytes / self.bytes_per_s * 1e3


@dataclass(frozen=True)
class FetchPlan:
    holder: object  # the instance to fetch from
    num_blocks: int  # the prompt's leading blocks the prefill instance holds once fetched
    own_blocks: int  # those it holds now
    transfer_ms: float
    saved_ms: float

    @property
    def extra_blocks(self) -> int:
        return self.num_blocks - self.own_blocks


def saved_prefill_ms(model: StepModel, prompt_tokens: int, own_tokens: int, fetched_tokens: int) -> float:
    """The prefill time of a `prompt_tokens` prompt starting after `own_tokens` cached tokens,
    less that starting after `fetched_tokens`: the fitted form's token and attention terms
    (prefill = a + b*sum(l) + c*sum(l^2), a prompt from cached c computing l - c tokens whose
    attention covers l^2 - c^2); the step's intercept is paid either way."""
    coefficients = model.prefill

    def cost(cached: int) -> float:
        return coefficients.b * (prompt_tokens - cached) + coefficients.c * (prompt_tokens**2 - cached**2)

    return cost(own_tokens) - cost(fetched_tokens) + model.expert_ms(fetched_tokens - own_tokens)


def plan_fetch(
    prefill: Holder,
    model: StepModel,
    holders: Sequence[Holder],
    block_hashes: Sequence[int],
    prompt_tokens: int,
    block_size: int,
    block_bytes: int,
    rate: FetchRate,
) -> FetchPlan | None:
    """The fetch for a prompt (`block_hashes`: its leading full blocks, as the block manager
    hashes them) to be prefilled on `prefill` (priced by `model`), from the holder of the most
    blocks beyond its own; None when no holder has more, or the transfer is predicted no faster
    than computing them."""
    own = prefill.cached_tokens(block_hashes) // block_size
    best, most = None, own
    for holder in holders:
        held = holder.cached_tokens(block_hashes) // block_size
        if holder is not prefill and held > most:
            best, most = holder, held
    if best is None:
        return None
    transfer_ms = rate.transfer_ms((most - own) * block_bytes)
    saved_ms = saved_prefill_ms(model, prompt_tokens, own * block_size, most * block_size)
    if not transfer_ms < saved_ms:
        return None
    return FetchPlan(best, most, own, transfer_ms, saved_ms)
