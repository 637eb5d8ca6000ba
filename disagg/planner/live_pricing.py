"""What each split would give from now on (issue 53, item 1): the simulator started from the
live state (disagg.planner.live_state) serves traffic like the last window's.

Each instance steps at its own fitted model times its host factor (what its measured steps show
of the cores it shares); those models were measured beside the other engines, so the profile's
own host-sharing slowdown is not added on top. Without a live state a split is priced from an
empty system with the configured profile, as `disagg plan` does.

`price_splits` is a plain function of plain data, so the server runs it in a process of its own
(disagg.router.replan_pricer), off its event loop's thread and its GIL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from disagg.config import ServingConfig
from disagg.placement.profile import Profile
from disagg.planner.deployment import Deployment, with_split
from disagg.planner.live_state import Arrangement, LiveState
from disagg.planner.replanner import Split, reachable_splits
from disagg.planner.simulator import SimInstance, Simulator, num_met, slo_attainment
from disagg.planner.workload import SimRequest

SWITCH_S = 2.0  # an idle instance to serving in its new role (bench_replan's `switch p50 s` measures it)
# A new instance to serving (placement, process, weights, warm-up): an estimate, not measured
# here; scaling prices the added instance as joining this late (disagg.planner.scaling).
LAUNCH_S = 20.0


@dataclass(frozen=True)
class Price:
    attainment: float  # percent of the requests that met their SLO
    goodput: float  # requests per second that met it


def price_splits(
    config: ServingConfig,
    profiles: dict[str, Profile],
    live: LiveState | None,
    requests: list[SimRequest],
    window_s: float,
    switch_s: float = SWITCH_S,
    splits: list[Split] | None = None,
    launch_s: float = LAUNCH_S,
) -> dict[Split, Price]:
    """Each split's price on `requests` (arrivals from 0, over `window_s`): `splits`, else every
    reachable split of the config's instances. A split with one instance more than the live
    state's has it join `launch_s` from now (scaling), a switched one `switch_s`. Where a split
    of one instance more or fewer is priced, every split is judged on the window's traffic once an
    added one serves (`extended`)."""
    if splits is None:
        splits = reachable_splits(config.prefill.num_instances + config.decode.num_instances)
    size = len(live.instances) if live is not None else None
    judged_from = 0.0
    if size is not None and any(split.prefill + split.decode != size for split in splits):
        # An instance joining launch_s from now serves none of a shorter window, and one instance
        # fewer falling behind builds its queue slowly: every split is judged on a window's worth
        # of the same traffic arriving once an added one serves, the traffic before that (the
        # window's, going on as it came) loading them all alike.
        requests, judged_from = extended(requests, window_s, launch_s + window_s), launch_s
    return {split: price_split(config, profiles, live, split, requests, window_s,
                               launch_s if size is not None and split.prefill + split.decode > size else switch_s,
                               judged_from)
            for split in splits}  # fmt: skip


def extended(requests: list[SimRequest], window_s: float, horizon_s: float) -> list[SimRequest]:
    """The window's traffic going on as it came until `horizon_s`: its arrivals repeated every `window_s`."""
    if window_s <= 0 or not requests:
        return requests
    arrivals = [(k * window_s + r.arrival_s, r) for k in range(math.ceil(horizon_s / window_s)) for r in requests]
    return [replace(r, index=i, arrival_s=at) for i, (at, r) in enumerate(a for a in arrivals if a[0] < horizon_s)]


def price_split(
    config: ServingConfig,
    profiles: dict[str, Profile],
    live: LiveState | None,
    split: Split,
    requests: list[SimRequest],
    window_s: float,
    switch_s: float = SWITCH_S,
    judged_from: float = 0.0,
) -> Price:
    """`split`'s price on the requests arriving from `judged_from` on (the earlier ones load it)."""
    sim = Deployment(with_split(config, split.prefill, split.decode), profiles).simulator()
    if live is not None:
        start_from(sim, live.arrange(split), switch_s)
    records = [r for r in sim.run(requests) if r.arrival_s >= judged_from]
    if not records:  # nothing arrives (an idle window): nothing to miss, on any split
        return Price(100.0, 0.0)
    return Price(slo_attainment(records, config.slo), num_met(records, config.slo) / max(window_s, 1e-9))


def start_from(sim: Simulator, arrangement: Arrangement, switch_s: float) -> None:
    """The simulator's instances as the live ones: their models, their work, and the one a
    switch moves serving only `switch_s` from now."""
    sim.host_sharing = None  # measured beside the others: the sharing is in the live models
    for role, members in arrangement.members.items():
        for instance, live in zip(list(sim.instances[role]), members):
            instance.become(instance.pool, live.step_model)
            for tokens in arrangement.prompts.get(live.instance_id, []) if role == "prefill" else []:
                sim.seed_prompt(instance, tokens)
            for decode in arrangement.decodes.get(live.instance_id, []) if role == "decode" else []:
                sim.seed_decode(instance, decode.context_tokens, decode.remaining_tokens)
            if live.instance_id in arrangement.joining:
                sim.instances[role].remove(instance)
                sim.at(switch_s, _join, sim, role, instance)


def _join(now: float, sim: Simulator, role: str, instance: SimInstance) -> None:
    sim.instances[role].append(instance)
