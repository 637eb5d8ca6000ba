"""The plan for the whole of one host, such as the 2 cores of a CPU machine.

The search ranks candidates by goodput per device and replicates the best, as if its copies did
not touch each other. On one host they do: a CPU's "devices" are cores of one machine, and
instances on it share its memory bandwidth and cores (`HostSharing`). So each candidate is
replicated over all the host's devices (as many whole copies as fit) and simulated whole, with
the search's own machinery (`reference_candidate`), and the host's plan is the one with the
highest rate. A host may be described by several kinds (`cpu-1t`: two devices of one thread;
`cpu-2t`: one device of two threads): each kind's search gives its own candidates.

Pure Python: the planner runs on any laptop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from disagg.planner.reference import ReferencePool, reference_candidate
from disagg.planner.search import Candidate, Search


@dataclass
class HostPlan:
    """A candidate filling one host, its rate simulated whole, with the search that found it."""

    candidate: Candidate
    search: Search
    per_device_rate: float  # what the search ranked it by, before replication

    @property
    def rate(self) -> float:
        return self.candidate.max_rate

    @property
    def hardware(self) -> str:
        return next(iter(self.candidate.pools.values())).hardware

    @property
    def label(self) -> str:
        """e.g. "disaggregated 1P+1D cpu-1t", "colocated chunked/512 x1 cpu-2t"."""
        c = self.candidate
        if c.mode == "disaggregated":
            return f"disaggregated {c.pools['prefill'].instances}P+{c.pools['decode'].instances}D {self.hardware}"
        pool = c.pools["colocated"]
        return f"colocated {pool.scheduling_policy}/{pool.max_num_batched_tokens} x{pool.instances} {self.hardware}"


def replicas_on_host(candidate: Candidate, host_devices: int) -> int:
    """Whole copies of the candidate the host's devices hold (0: it does not fit)."""
    return host_devices // candidate.devices if candidate.devices else 0


def replicated_pools(candidate: Candidate, replicas: int) -> list[ReferencePool]:
    """The candidate's pools with every instance count multiplied, engine settings kept."""
    return [
        ReferencePool(
            role,
            pool.tp,
            pool.pp,
            pool.instances * replicas,
            pool.hardware,
            {"scheduling_policy": pool.scheduling_policy, "max_num_batched_tokens": pool.max_num_batched_tokens},
        )
        for role, pool in candidate.pools.items()
    ]


def on_host(search: Search, candidate: Candidate) -> HostPlan | None:
    """The candidate replicated over one node of the search's (only) kind, simulated whole."""
    replicas = replicas_on_host(candidate, search.kinds[0].devices_per_node)
    if replicas < 1:
        return None
    whole = reference_candidate(search, replicated_pools(candidate, replicas))
    whole = replace(whole, algorithm=candidate.algorithm, notes={**candidate.notes, "replicas_on_host": replicas})
    return HostPlan(whole, search, candidate.goodput_per_device)


def host_plans(searched: list[tuple[Search, list[Candidate]]]) -> list[HostPlan]:
    """Every candidate of every kind's search on the whole host, the highest rate first."""
    plans = [on_host(search, c) for search, candidates in searched for c in candidates if c.max_rate > 0]
    return sorted((p for p in plans if p is not None), key=lambda p: -p.rate)
