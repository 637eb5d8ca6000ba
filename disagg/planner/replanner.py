"""The re-planner's decisions: which prefill:decode split of the instances serves the traffic of
the last window best, and whether moving to it is worth a switch (issue 36, item 3).

Every `decide`, the window's requests (their arrival pattern and lengths, as the router saw
them) are replayed by the simulator (the classes `disagg plan` uses) on each reachable split:
every (prefill, decode) of the same instances with at least one of each, since the last of a
pool is never removed. The split with the highest predicted SLO attainment is the best. A switch
is due only when (hysteresis, so that it never oscillates):

- the best beats the current split by at least `min_gain` points of attainment (below that the
  prediction's own error, and the switch's cost, outweigh it);
- the same best has come out of `confirmations` decisions in a row (one noisy window moves
  nothing);
- `hold_s` have passed since the last switch (the traffic after a switch reflects it).

A switch moves one instance at a time, toward the best split; the next decisions go on from
there. The server's loop (and the simulator's replay of a re-planning server) apply them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from disagg.config import ServingConfig
from disagg.placement.profile import Profile
from disagg.planner.deployment import Deployment, with_split
from disagg.planner.simulator import slo_attainment
from disagg.slo import SLO
from disagg.planner.workload import SimRequest

MIN_WINDOW_REQUESTS = 8  # fewer: too little to tell one split from another
# A window holding fewer reaches back this many windows for them: sparse traffic of long requests
# (a few 800-token prompts in 15 s) is the load that needs a split most, not too little to price.
WINDOW_STRETCH = 2.0
# The traffic shifted when the latest half window's prompt tokens per output token are this many
# times the rest of the window's (or under its 1/SHIFT_RATIO): a round then prices the latest half
# alone, played twice over the window, instead of a mix that is mostly the traffic gone (in
# bench_replan the way back to prefill-heavy was decided 4.4-5.5 s in with it, 6.5 s in the one run
# without; the move to decode-heavy was held by the pricing, not the window). ShareGPT's mix is
# heavy-tailed: two samples of 4 of its requests (DistServe's vLLM runs, ../shared/data/distserve)
# differ 10x or more 7.6% of the time, of 8 0.7%, and a false alarm prices only the recent traffic;
# prefill-heavy against decode-heavy traffic (800-token prompts, 6 out; 30 in, 175 out) differ ~100x.
SHIFT_RATIO = 10.0
MIN_HALF_REQUESTS = 4  # in each half, to tell a shift from a few requests' noise


@dataclass(frozen=True)
class Split:
    prefill: int
    decode: int

    def __str__(self) -> str:
        return f"{self.prefill}P:{self.decode}D"

    def toward(self, target: "Split") -> "Split":
        """One instance moved from the pool over target to the one under it."""
        if target.prefill > self.prefill:
            return Split(self.prefill + 1, self.decode - 1)
        if target.prefill < self.prefill:
            return Split(self.prefill - 1, self.decode + 1)
        return self


def reachable_splits(total: int) -> list[Split]:
    """Every split of `total` instances that keeps one in each pool."""
    if total < 2:
        raise ValueError("re-planning needs at least two instances (one prefill, one decode)")
    return [Split(p, total - p) for p in range(1, total)]


class TrafficWindow:
    """The requests that arrived in the last `window_s` seconds (at most `max_requests`); what a
    round prices (`for_pricing`) reaches back up to WINDOW_STRETCH windows for enough of them."""

    def __init__(self, window_s: float = 30.0, max_requests: int = 4096):
        self.window_s = window_s
        self._seen: deque[tuple] = deque(maxlen=max_requests)

    def add(
        self, arrival_s: float, prompt_len: int, output_len: int, slo: SLO | None = None, priority: int = 0
    ) -> None:
        """`output_len`: what the router expects it to write (its configured output length
        source); `slo`: its own targets (None: the server's); `priority`: the engines'."""
        self._seen.append((arrival_s, max(1, prompt_len), max(1, output_len), slo, priority))

    def requests(self, now: float, since: float | None = None, at_least: int = 0) -> list[SimRequest]:
        """The window's requests (or those since `since`) in arrival order, arrivals counted from
        the first (what the simulator replays); fewer than `at_least`: the latest `at_least` that
        arrived in the last WINDOW_STRETCH windows (and since `since`)."""
        oldest = now - WINDOW_STRETCH * self.window_s
        while self._seen and self._seen[0][0] < oldest:
            self._seen.popleft()
        floor = oldest if since is None else max(oldest, since)
        seen = sorted((seen for seen in self._seen if floor <= seen[0] <= now), key=lambda seen: seen[0])
        recent = [s for s in seen if s[0] >= now - self.window_s]
        if len(recent) < at_least:
            recent = seen[-at_least:]
        first = recent[0][0] if recent else now
        return [SimRequest(i, t - first, p, o, priority=k, slo=slo) for i, (t, p, o, slo, k) in enumerate(recent)]

    def for_pricing(self, now: float) -> list[SimRequest]:
        """What a round prices: the window's requests, at least MIN_WINDOW_REQUESTS where the
        stretched window holds them; where the traffic shifted in the window's latest half
        (`shifted`), that half played twice over the window (its arrival rate kept)."""
        window = self.requests(now, at_least=MIN_WINDOW_REQUESTS)
        half_s = self.window_s / 2
        latest = self.requests(now, since=now - half_s)
        if not shifted(window[: len(window) - len(latest)], latest):
            return window
        again = [replace(r, arrival_s=r.arrival_s + half_s) for r in latest]
        return [replace(r, index=i) for i, r in enumerate(latest + again)]


def shifted(earlier: list[SimRequest], latest: list[SimRequest]) -> bool:
    """Whether the latest requests' mix of work (prompt tokens per output token) is SHIFT_RATIO
    times the earlier ones' or more, either way, each with MIN_HALF_REQUESTS or more."""
    if min(len(earlier), len(latest)) < MIN_HALF_REQUESTS:
        return False
    ratio = _prompt_per_output(latest) / _prompt_per_output(earlier)
    return ratio >= SHIFT_RATIO or ratio <= 1 / SHIFT_RATIO


def _prompt_per_output(requests: list[SimRequest]) -> float:
    return sum(r.prompt_len for r in requests) / max(1, sum(r.output_len for r in requests))


@dataclass
class Decision:
    now: float
    current: Split
    best: Split
    predicted: dict[Split, float]  # attainment (percent) of each reachable split on the window's traffic
    switch_to: Split | None  # the one-instance step toward `best`, when a switch is due
    reason: str
    predicted_goodput: dict[Split, float] = field(default_factory=dict)  # req/s meeting their SLO

    @property
    def gain(self) -> float:
        return self.predicted.get(self.best, 0.0) - self.predicted.get(self.current, 0.0)


@dataclass
class Replanner:
    """`simulate(split, requests)` -> the simulator's records of those requests on that split."""

    simulate: Callable[[Split, list[SimRequest]], list]
    total_instances: int
    slo: SLO
    min_gain: float = 5.0  # points of attainment
    confirmations: int = 2
    hold_s: float = 20.0
    history: list[Decision] = field(default_factory=list)
    _last_switch_at: float = -math.inf
    _streak: tuple[Split | None, int] = (None, 0)
    _vetoed: dict[Split, float] = field(default_factory=dict)  # split -> until when it is not chosen

    def predict(self, requests: list[SimRequest]) -> dict[Split, float]:
        return {
            split: slo_attainment(self.simulate(split, requests), self.slo)
            for split in reachable_splits(self.total_instances)
        }

    def veto(self, split: Split, until: float) -> None:
        """`split` is not chosen again before `until` (a switch to it measured worse than staying)."""
        self._vetoed[split] = until

    def undone(self, now: float) -> None:
        """A switch was just undone (or a scale step taken): the hold starts again from now."""
        self._last_switch_at, self._streak = now, (None, 0)

    def decide(
        self, now: float, current: Split, window: TrafficWindow, predicted: dict[Split, float] | None = None
    ) -> Decision:
        """`predicted`: each split's attainment on the window's traffic, priced elsewhere (None:
        by `simulate` here, given enough requests in the window; the caller that prices judges
        whether it had enough: disagg.planner.live_state.enough_to_price)."""
        requests = window.for_pricing(now)
        if not predicted and len(requests) < MIN_WINDOW_REQUESTS:
            return self._record(Decision(now, current, current, {}, None, f"{len(requests)} requests in the window"))
        predicted = predicted or self.predict(requests)
        allowed = {s: v for s, v in predicted.items() if s == current or self._vetoed.get(s, -math.inf) <= now}
        # Ties go to the current split, then to the one nearest it: no switch that gains nothing.
        best = max(allowed, key=lambda s: (allowed[s], s == current, -abs(s.prefill - current.prefill)))
        decision = Decision(now, current, best, predicted, None, "")
        streak = self._streak[1] + 1 if self._streak[0] == best else 1
        self._streak = (best, streak)
        if best == current:
            decision.reason = "the current split is the best"
        elif decision.gain < self.min_gain:
            decision.reason = f"gain {decision.gain:.1f} points < {self.min_gain}"
        elif streak < self.confirmations:
            decision.reason = f"best {best} seen {streak} of {self.confirmations} times in a row"
        elif now - self._last_switch_at < self.hold_s:
            decision.reason = f"{now - self._last_switch_at:.0f}s since the last switch < {self.hold_s:.0f}s"
        else:
            decision.switch_to = current.toward(best)
            decision.reason = f"{best} predicted {decision.gain:.1f} points over {current}"
            self._last_switch_at = now
            self._streak = (None, 0)
        return self._record(decision)

    def _record(self, decision: Decision) -> Decision:
        self.history.append(decision)
        del self.history[:-256]  # the latest decisions (for `disagg status` and the log)
        return decision


def split_simulator(config: ServingConfig, profiles: dict[str, Profile]) -> Callable[[Split, list[SimRequest]], list]:
    """Replays requests on `config` with a given split: the server's deployment, as `disagg plan`
    and `disagg simulate` build it (`profiles`: per role, as Deployment takes them)."""

    def simulate(split: Split, requests: list[SimRequest]) -> list:
        return Deployment(with_split(config, split.prefill, split.decode), profiles).simulator().run(requests)

    return simulate
