"""Every switch checked against what followed it (issue 53, item 2).

A switch's check opens when the instance serves in its new role and closes when the hold after
the decision is over (`hold_s`: no other switch can come before, so nothing else moved meanwhile;
the loop goes on deciding, and closes the check first in the round where a switch could follow).
By then the loop knows what the new split measured (attainment and goodput of the requests
judged since it opened) and can price both splits again on the traffic of that span. Staying is
estimated as the measurement plus the predicted difference between the old split and the new
one on that same traffic: whatever the model gets wrong about both alike cancels out. A switch
that measured worse than staying by more than `margin` points is undone. Either way the miss
(measured less predicted on that traffic, for the split that served) is learnt: a residual per
split, an exponential mean of its misses, which later rounds add to that split's predictions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.planner.live_pricing import Price
from disagg.planner.replanner import MIN_WINDOW_REQUESTS, Split

RESIDUAL_WEIGHT = 0.5  # of the newest miss in a split's residual (an exponential mean)
# A check short of requests at the end of the hold waits for more, up to this many holds after
# the decision: at a low rate (a few long prompts a window) it would else close unmeasured, and
# a switch measured worse than staying would never be undone.
CHECK_PATIENCE_HOLDS = 3.0


@dataclass
class Check:
    decided_at: float  # the decision's time (the loop's clock)
    before: Split
    after: Split
    predicted: Price  # of `after`, at the decision
    predicted_stay: Price  # of `before`, at the decision
    opens_at: float  # once serving in the new split: the window measured starts here
    measured: Price | None = None
    stay: Price | None = None  # what staying would have measured on the window's traffic (estimated)
    outcome: str = "pending"  # pending | kept | undone

    def due(self, now: float, hold_s: float) -> bool:
        """Whether it closes now: its new split serves, and the hold after the decision is over."""
        return self.opens_at < now and now >= self.decided_at + hold_s

    def readiness(self, now: float, hold_s: float, judged: int, arrived: int) -> str:
        """Once due: "measure" with a request judged and MIN_WINDOW_REQUESTS arrived since it
        opened; else "wait" for more, up to CHECK_PATIENCE_HOLDS after the decision; then
        "unmeasured"."""
        if judged > 0 and arrived >= MIN_WINDOW_REQUESTS:
            return "measure"
        return "wait" if now < self.decided_at + CHECK_PATIENCE_HOLDS * hold_s else "unmeasured"

    @property
    def predicted_gain(self) -> float:
        return self.predicted.attainment - self.predicted_stay.attainment

    @property
    def measured_gain(self) -> float | None:
        if self.measured is None or self.stay is None:
            return None
        return self.measured.attainment - self.stay.attainment

    @property
    def sign_right(self) -> bool | None:
        """Whether the switch's measured effect had the sign predicted (None while pending)."""
        gain = self.measured_gain
        return None if gain is None else (gain >= 0) == (self.predicted_gain >= 0)


@dataclass
class DecisionChecker:
    margin: float = 5.0  # points of attainment a switch may measure under staying before it is undone
    residuals: dict[Split, float] = field(default_factory=dict)  # split -> mean miss (measured - predicted), points
    checks: list[Check] = field(default_factory=list)  # the latest, newest last

    def open(self, check: Check) -> None:
        self.checks.append(check)
        del self.checks[:-64]

    @property
    def pending(self) -> Check | None:
        return next((c for c in reversed(self.checks) if c.outcome == "pending"), None)

    def corrected(self, split: Split, price: Price) -> Price:
        """`price` plus what predictions of `split` have missed so far (goodput scaled alike)."""
        residual = self.residuals.get(split, 0.0)
        if not residual:
            return price
        attainment = min(100.0, max(0.0, price.attainment + residual))
        scale = attainment / price.attainment if price.attainment > 0 else 1.0
        return Price(attainment, price.goodput * scale)

    def close(self, check: Check, measured: Price, priced: dict[Split, Price]) -> str:
        """The check's outcome: "undone" when the new split measured worse than staying;
        `priced`: both splits priced on the measured window's traffic (uncorrected)."""
        after, before = priced[check.after], priced[check.before]
        self.learn(check.after, measured.attainment - after.attainment)
        stay_attainment = min(100.0, max(0.0, measured.attainment + before.attainment - after.attainment))
        check.measured = measured
        check.stay = Price(stay_attainment, max(0.0, measured.goodput + before.goodput - after.goodput))
        worse = measured.attainment + self.margin < check.stay.attainment
        check.outcome = "undone" if worse else "kept"
        return check.outcome

    def learn(self, split: Split, miss: float) -> None:
        old = self.residuals.get(split)
        self.residuals[split] = miss if old is None else (1 - RESIDUAL_WEIGHT) * old + RESIDUAL_WEIGHT * miss

    def sign_share(self) -> float | None:
        """Of the closed checks, the share whose measured effect had the predicted sign."""
        signs = [c.sign_right for c in self.checks if c.sign_right is not None]
        return sum(signs) / len(signs) if signs else None
