"""Scale, not only switch (issue 53, item 3): whether to add an instance to a pool or remove one.

Each round the loop prices, beside the switches, the splits one instance away from the present
one (one more in a pool where the cluster has room for a whole instance of that pool's shape,
one fewer in a pool of two or more) with the same live-state pricing (disagg.planner.live_pricing).

- **Add** to the pool whose extra instance predicts the most SLO attainment, when it beats
  staying by `min_gain` points: the pool that limits goodput.
- **Remove** one from a pool when the window's load fits in fewer: the smaller split predicts
  attainment within FIT_TOLERANCE points of staying and at least 100 - `min_gain` (nearly every
  request met; an overloaded system never sheds an instance because all splits miss alike).

An add is preferred to a remove. A step must stay within the bounds (`max_per_pool`,
`max_total`) and, with a P:D ratio target, keep the prefill pool within one instance of
`target x decode instances` (a step from further off only moves closer). As switches do, the
same step must come out of `confirmations` rounds in a row, and at most one step (switch or
scale) per `hold_s`; never below one instance a pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from disagg.planner.live_pricing import Price
from disagg.planner.replanner import Split

FIT_TOLERANCE = 1.0  # points of attainment a removal may lose against staying and still "fit"
ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class ScaleBounds:
    max_per_pool: int  # instances in one pool at most (0 or 1: no adding)
    max_total: int = 0  # instances in both pools at most (0: no bound beyond max_per_pool)
    pd_ratio: float = 0.0  # prefill instances per decode instance to keep (0: none)

    def __post_init__(self) -> None:
        if self.max_per_pool < 0 or self.max_total < 0 or self.pd_ratio < 0:
            raise ValueError(f"scale bounds must be >= 0: {self}")


@dataclass(frozen=True)
class ScaleStep:
    role: str  # the pool that grows or shrinks
    delta: int  # +1: add an instance; -1: remove one
    target: Split
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.delta > 0 else "down"


def stepped(split: Split, role: str, delta: int) -> Split:
    """`split` with `delta` instances more in `role`'s pool."""
    if role == "prefill":
        return Split(split.prefill + delta, split.decode)
    return Split(split.prefill, split.decode + delta)


def pool_size(split: Split, role: str) -> int:
    return split.prefill if role == "prefill" else split.decode


def ratio_allows(before: Split, after: Split, target: float) -> bool:
    """Whether `after` keeps the P:D target (0: none): within one prefill instance of it, or no
    further off than `before`."""
    if target <= 0:
        return True
    off = lambda s: abs(s.prefill - target * s.decode)  # noqa: E731
    return off(after) <= max(1.0, off(before))


def within_bounds(split: Split, bounds: ScaleBounds, delta: int) -> bool:
    """Never the last of a pool; an add (`delta` 1) within the upper bounds too (a removal may
    start above them: a deployment configured bigger)."""
    if min(split.prefill, split.decode) < 1:
        return False
    if delta < 0:
        return True
    if max(split.prefill, split.decode) > max(1, bounds.max_per_pool):
        return False
    return bounds.max_total <= 0 or split.prefill + split.decode <= bounds.max_total


def candidates(current: Split, bounds: ScaleBounds, room: dict[str, bool]) -> list[tuple[str, int, Split]]:
    """Every one-instance step allowed now: (role, delta, the split it reaches). An add needs
    room for a whole instance of the pool (`room[role]`)."""
    steps = [(role, 1, stepped(current, role, 1)) for role in ROLES if room.get(role)]
    steps += [(role, -1, stepped(current, role, -1)) for role in ROLES]
    return [(role, delta, split) for role, delta, split in steps
            if within_bounds(split, bounds, delta) and ratio_allows(current, split, bounds.pd_ratio)]  # fmt: skip


def best_step(current: Split, priced: dict[Split, Price], bounds: ScaleBounds, room: dict[str, bool],
              min_gain: float, vetoed: frozenset[Split] = frozenset()) -> ScaleStep | None:  # fmt: skip
    """The add that beats staying by `min_gain`, else the removal the load fits in, else None;
    never to a `vetoed` split."""
    stay = priced.get(current)
    if stay is None:
        return None
    allowed = [(r, d, s) for r, d, s in candidates(current, bounds, room) if s in priced and s not in vetoed]
    adds = [(r, s) for r, d, s in allowed if d > 0 and priced[s].attainment - stay.attainment >= min_gain]
    if adds:
        role, split = max(adds, key=lambda a: (priced[a[1]].attainment, priced[a[1]].goodput))
        gain = priced[split].attainment - stay.attainment
        return ScaleStep(role, 1, split, f"add a {role} instance: {split} predicted {gain:.1f} points over {current}")
    removes = [(r, s) for r, d, s in allowed if d < 0 and _fits(priced[s], stay, min_gain)]
    if not removes:
        return None
    role, split = max(removes, key=lambda r: (priced[r[1]].attainment, pool_size(current, r[0])))
    return ScaleStep(role, -1, split, f"remove a {role} instance: the window's load fits {split} "
                                      f"({priced[split].attainment:.1f}% against {stay.attainment:.1f}%)")  # fmt: skip


def _fits(smaller: Price, stay: Price, min_gain: float) -> bool:
    return smaller.attainment >= stay.attainment - FIT_TOLERANCE and smaller.attainment >= 100.0 - min_gain


@dataclass
class ScalePolicy:
    """`best_step` with the switches' hysteresis: the same step `confirmations` rounds in a row,
    at most one step per `hold_s` (the loop calls `acted` after a switch too)."""

    bounds: ScaleBounds
    min_gain: float = 5.0
    confirmations: int = 2
    hold_s: float = 20.0
    _last_at: float = -math.inf
    _streak: tuple[ScaleStep | None, int] = (None, 0)
    history: list[ScaleStep] = field(default_factory=list)
    _vetoed: dict[Split, float] = field(default_factory=dict)  # split -> until when no step goes to it

    def decide(self, now: float, current: Split, priced: dict[Split, Price], room: dict[str, bool]) -> ScaleStep | None:
        vetoed = frozenset(split for split, until in self._vetoed.items() if until > now)
        step = best_step(current, priced, self.bounds, room, self.min_gain, vetoed)
        same = step is not None and self._streak[0] is not None and _same(self._streak[0], step)
        self._streak = (step, self._streak[1] + 1 if same else 1)
        if step is None or self._streak[1] < self.confirmations or now - self._last_at < self.hold_s:
            return None
        self.acted(now)
        self.history.append(step)
        del self.history[:-64]
        return step

    def veto(self, split: Split, until: float) -> None:
        """No step to `split` before `until` (a step to it measured worse than staying)."""
        self._vetoed[split] = until

    def acted(self, now: float) -> None:
        """A step (a scale or a switch) was taken now: the hold starts again."""
        self._last_at, self._streak = now, (None, 0)


def _same(a: ScaleStep, b: ScaleStep) -> bool:
    return (a.role, a.delta, a.target) == (b.role, b.delta, b.target)
