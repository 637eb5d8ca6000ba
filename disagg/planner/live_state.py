"""The system as it is now, what a re-planning round prices from (issue 53, item 1).

Replaying the last window's traffic on an empty system misses what under load is most of the
cost: the prompts queued, the decodes in flight and the KV they hold. A round therefore starts
each candidate split from the live state: every instance with its own fitted step model, its
queued prompts and its running decodes (context and tokens left). The instances that keep their
role keep their work; the one a split moves (the least busy of the pool that shrinks, as the
server's switch picks it) hands its decodes to the pool it leaves (the server migrates them with
their KV) and its queued prompts to the rest of its pool, and joins its new pool `switch_s` later.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from disagg.placement.latency_model import StepModel
from disagg.planner.replanner import MIN_WINDOW_REQUESTS, Split
from disagg.step_work import MeasuredStep

MIN_FACTOR, MAX_FACTOR = 0.25, 8.0  # a host factor outside these is a measurement gone wrong


@dataclass(frozen=True)
class LiveDecode:
    context_tokens: int  # prompt and output so far: the KV it holds
    remaining_tokens: int  # output tokens still to come (expected, or what max_tokens leaves)


@dataclass(frozen=True)
class LiveInstance:
    instance_id: str
    role: str  # "prefill" | "decode"
    step_model: StepModel  # its own (each side fitted where it is calibrated), times its host factor
    queued_prompts: tuple[int, ...] = ()  # prompt tokens left to compute, one entry per prompt
    decodes: tuple[LiveDecode, ...] = ()

    @property
    def num_requests(self) -> int:
        return len(self.queued_prompts) + len(self.decodes)


@dataclass(frozen=True)
class Arrangement:
    """Who serves in which pool under a split, and the work each starts with."""

    members: dict[str, list[LiveInstance]]  # role -> instances, in the simulator's order
    prompts: dict[str, list[int]] = field(default_factory=dict)  # instance id -> queued prompt tokens
    decodes: dict[str, list[LiveDecode]] = field(default_factory=dict)  # instance id -> running decodes
    joining: frozenset[str] = frozenset()  # moved in by this split: serving after the switch


@dataclass(frozen=True)
class LiveState:
    instances: tuple[LiveInstance, ...]

    def by_role(self, role: str) -> list[LiveInstance]:
        return [i for i in self.instances if i.role == role]

    @property
    def split(self) -> Split:
        return Split(len(self.by_role("prefill")), len(self.by_role("decode")))

    def arrange(self, split: Split) -> Arrangement:
        """`split` reached from now: the least busy instances of the shrinking pool move (or, one
        instance more or fewer, one is added or removed: disagg.planner.scaling)."""
        change = split.prefill + split.decode - len(self.instances)
        if change == 1:
            return self._added(split)
        if change == -1:
            return self._removed(split)
        if change != 0:
            raise ValueError(f"split {split}: the live state has {len(self.instances)} instances")
        shrinking = "prefill" if split.prefill < self.split.prefill else "decode"
        growing = "decode" if shrinking == "prefill" else "prefill"
        pool = sorted(self.by_role(shrinking), key=lambda i: (i.num_requests, i.instance_id))
        moving = pool[: abs(split.prefill - self.split.prefill)]
        joining = frozenset(i.instance_id for i in moving)
        members = {shrinking: pool[len(moving) :], growing: self.by_role(growing) + moving}
        prompts = {i.instance_id: list(i.queued_prompts) for i in self.instances if i.instance_id not in joining}
        decodes = {i.instance_id: list(i.decodes) for i in self.instances if i.instance_id not in joining}
        for leaving in moving:  # its work goes to the pool it leaves, least loaded first
            _spread(prompts, leaving.queued_prompts, _homes(members["prefill"], joining))
            _spread(decodes, leaving.decodes, _homes(members["decode"], joining))
        return Arrangement(members, prompts, decodes, joining)

    def _added(self, split: Split) -> Arrangement:
        """One more instance in the pool that grows: a new one, stepping as its first peer does,
        joining once launched; everyone else keeps their work."""
        growing = "prefill" if split.prefill > self.split.prefill else "decode"
        peers = self.by_role(growing)
        if not peers or split.prefill < self.split.prefill or split.decode < self.split.decode:
            raise ValueError(f"split {split}: not one instance added to {self.split}")
        new = LiveInstance(f"new-{growing}", growing, peers[0].step_model)
        members = {role: self.by_role(role) + ([new] if role == growing else []) for role in ("prefill", "decode")}
        return Arrangement(
            members, self._prompts(frozenset()), self._decodes(frozenset()), frozenset({new.instance_id})
        )

    def _removed(self, split: Split) -> Arrangement:
        """One instance fewer in the pool that shrinks: its least busy leaves (drained as a switch
        drains), its work to the rest of its pool."""
        shrinking = "prefill" if split.prefill < self.split.prefill else "decode"
        pool = sorted(self.by_role(shrinking), key=lambda i: (i.num_requests, i.instance_id))
        if len(pool) < 2 or split.prefill > self.split.prefill or split.decode > self.split.decode:
            raise ValueError(f"split {split}: not one instance removed from {self.split} (never the last of a pool)")
        leaving = pool[0]
        gone = frozenset({leaving.instance_id})
        members = {role: [i for i in self.by_role(role) if i.instance_id not in gone] for role in ("prefill", "decode")}
        prompts, decodes = self._prompts(gone), self._decodes(gone)
        _spread(prompts, leaving.queued_prompts, _homes(members["prefill"], gone))
        _spread(decodes, leaving.decodes, _homes(members["decode"], gone))
        return Arrangement(members, prompts, decodes)

    def _prompts(self, without: frozenset[str]) -> dict[str, list[int]]:
        return {i.instance_id: list(i.queued_prompts) for i in self.instances if i.instance_id not in without}

    def _decodes(self, without: frozenset[str]) -> dict[str, list[LiveDecode]]:
        return {i.instance_id: list(i.decodes) for i in self.instances if i.instance_id not in without}


def enough_to_price(window_requests: int, held: int) -> bool:
    """Whether a round has enough to tell one split from another: the window's arrivals and the
    requests the instances hold now (`held`: the round simulates both), MIN_WINDOW_REQUESTS
    together, at least one arrival among them. A few long requests a window keep the instances
    full (a decode of 600 tokens outlives four windows): the load a split matters for, not too
    little to price."""
    return window_requests > 0 and window_requests + held >= MIN_WINDOW_REQUESTS


def _homes(members: list[LiveInstance], joining: frozenset[str]) -> list[str]:
    return [i.instance_id for i in members if i.instance_id not in joining]


def _spread(held: dict[str, list], items, homes: list[str]) -> None:
    """Each item to the home holding fewest (the placement policy's least-loaded choice)."""
    for item in items:
        if homes:
            held[min(homes, key=lambda h: len(held.setdefault(h, [])))].append(item)


def host_factor(steps: list[MeasuredStep], model: StepModel) -> float:
    """How much slower the instance's measured steps ran than `model` prices them: the
    median ratio (1 with nothing measured). Engines sharing a host's cores show it here."""
    ratios = [s.ms / predicted for s in steps if (predicted := model.step_ms(s.work)) > 0 and s.ms > 0]
    if not ratios:
        return 1.0
    return min(MAX_FACTOR, max(MIN_FACTOR, statistics.median(ratios)))
