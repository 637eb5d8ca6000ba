"""A reference deployment beside the plan (`disagg plan --compare`).

The operator names a deployment, a serving config or a compact spec such as
`prefill=tp2x1,decode=tp1x1` (DistServe's OPT-13B placement), and it is simulated by the same
machinery as every candidate (`Search.pool`, `Search.max_rate`), so the two rates compare like
for like: same profile, workload, SLO and simulator.

Compact spec: `ROLE=tp<T>[pp<P>]x<N>[@HARDWARE]`, comma-separated; prefill and decode, or
colocated. Without `@HARDWARE` a pool runs on the cluster's first node kind; its engine settings
are the planner's for that role. A config's pools keep the config's own engine settings.

Pure Python: the planner runs on any laptop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from disagg.config import ServingConfig
from disagg.engine.model_config import ModelConfig
from disagg.planner.hardware import hardware_spec
from disagg.planner.memory import config_fit_errors
from disagg.planner.search import Candidate, NodeKind, Search, pool_plans

ROLES = ("prefill", "decode", "colocated")
_SHAPE = re.compile(r"^tp(\d+)(?:pp(\d+))?x(\d+)(?:@([a-z0-9.-]+))?$")


@dataclass(frozen=True)
class ReferencePool:
    role: str
    tp: int
    pp: int
    instances: int
    hardware: str | None = None  # None: the cluster's first node kind
    engine: dict = field(default_factory=dict, hash=False)  # what differs from the planner's settings


def parse_reference(text: str) -> list[ReferencePool]:
    """A serving config's path, or a compact spec."""
    if Path(text).is_file():
        return _from_config(ServingConfig.from_yaml(text))
    pools = [_parse_pool(part.strip(), text) for part in text.split(",")]
    roles = sorted(p.role for p in pools)
    if roles not in (["decode", "prefill"], ["colocated"]):
        raise ValueError(f"compare: {text!r} must name prefill and decode once each, or colocated")
    return pools


def _parse_pool(part: str, text: str) -> ReferencePool:
    role, _, shape = part.partition("=")
    match = _SHAPE.match(shape.strip().lower())
    if role.strip() not in ROLES or match is None or 0 in (int(match[1]), int(match[3])):
        raise ValueError(
            f"compare: {text!r} is neither a serving config file nor ROLE=tp<T>[pp<P>]x<N>[@HARDWARE],... "
            "(e.g. prefill=tp2x1,decode=tp1x1)"
        )
    tp, pp, instances, hardware = match.groups()
    return ReferencePool(role.strip(), int(tp), int(pp or 1), int(instances), hardware)


def check_config_fits(path: str, model: ModelConfig, kinds: list[NodeKind]) -> None:
    """A serving config compared against the plan must be one that starts: each worker's weights,
    KV cache and activations fit its pool's hardware (disagg.planner.memory.config_fit_errors)."""
    config = ServingConfig.from_yaml(path)
    hardware = {pool.role: _kind_of(pool, kinds).hardware for pool in _from_config(config)}
    errors = config_fit_errors(config, model, hardware)
    if errors:
        raise ValueError(
            f"compare: {path} would not start, its workers do not fit their devices:\n  " + "\n  ".join(errors)
        )


def _from_config(config: ServingConfig) -> list[ReferencePool]:
    pools = []
    for role, pool in config.pools():
        engine = config.pool_engine_config(pool)
        settings = {
            "scheduling_policy": engine.scheduling_policy,
            "max_num_batched_tokens": engine.max_num_batched_tokens,
            "max_num_seqs": engine.max_num_seqs,
            "long_prefill_token_threshold": engine.long_prefill_token_threshold,
            "long_prefill_by_work": engine.long_prefill_by_work,
        }
        shape = (pool.tensor_parallel_size, pool.pipeline_parallel_size, pool.num_instances)
        pools.append(ReferencePool(role, *shape, hardware=_labelled_hardware(pool.resources), engine=settings))
    return pools


def _labelled_hardware(resources: dict) -> str | None:
    """The hardware a pool is pinned to by its label (plan_config.hardware_label), if any."""
    for name in resources:
        try:
            return hardware_spec(name).name
        except ValueError:
            continue  # a pool label, or another resource
    return None


def reference_candidate(search: Search, pools: list[ReferencePool]) -> Candidate:
    """The reference simulated: the highest rate at which it meets the search's SLO."""
    kinds = [_kind_of(pool, search.kinds) for pool in pools]
    sim_pools = [search.pool(p.role, kind, p.tp, p.pp, p.instances, **p.engine) for p, kind in zip(pools, kinds)]
    devices = sum(p.tp * p.pp * p.instances for p in pools)
    one_node = len({id(k) for k in kinds}) == 1 and devices <= kinds[0].devices_per_node
    rate = search.max_rate(sim_pools, kinds[0].hardware.kv_transfer(inter_node=not one_node))
    mode = "colocated" if pools[0].role == "colocated" else "disaggregated"
    return Candidate(mode, pool_plans(sim_pools), rate, "reference")


def _kind_of(pool: ReferencePool, kinds: list[NodeKind]) -> NodeKind:
    if pool.hardware is None:
        return kinds[0]
    for kind in kinds:
        if kind.hardware.name == pool.hardware:
            return kind
    have = ", ".join(k.hardware.name for k in kinds)
    raise ValueError(f"compare: the {pool.role} pool's hardware {pool.hardware} is not in the cluster ({have})")
