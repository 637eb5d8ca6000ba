"""From a serving config to the placement policy it runs: the one place that maps the config's
`placement` name to a class and hands it the config's settings.

The server, the simulator (`disagg simulate`, `Deployment`), the planner's search and the load
scripts all build their policy here, so what is simulated or planned is what `disagg serve` runs
with the same config.
"""

from __future__ import annotations

from collections.abc import Callable

from disagg.config import ServingConfig
from disagg.placement.goodput import GoodputPolicy
from disagg.placement.narrowing import Narrowing
from disagg.placement.policies import LeastOutstandingWork, PlacementPolicy


def _goodput(config: ServingConfig) -> PlacementPolicy:
    return GoodputPolicy(
        best_effort=config.slo_admission == "best_effort",
        local_prefill_max_tokens=config.local_prefill_max_tokens,
        decode_reuse_max_tokens=config.decode_reuse_max_tokens,
        narrowing=Narrowing(candidates=config.placement_candidates),
    )


def _least_work(config: ServingConfig) -> PlacementPolicy:
    return LeastOutstandingWork()  # queues everything: it has no settings and refuses nothing


# Keyed by the names `disagg.config.PLACEMENTS` accepts.
PLACEMENT_POLICIES: dict[str, Callable[[ServingConfig], PlacementPolicy]] = {
    "goodput": _goodput,
    "least_work": _least_work,
}


def placement_policy(config: ServingConfig) -> PlacementPolicy:
    """The policy `config.placement` names, built with the config's admission settings."""
    build = PLACEMENT_POLICIES.get(config.placement)
    if build is None:
        known = ", ".join(PLACEMENT_POLICIES)
        raise ValueError(f"placement: unknown policy {config.placement!r} (known: {known})")
    return build(config)
