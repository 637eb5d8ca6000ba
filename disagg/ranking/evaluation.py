"""How well a ranker orders: Kendall's tau-b between predicted scores and true lengths.

Written out (O(n^2), fine for a few thousand items) so that training needs no scipy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def kendall_tau_b(xs: Sequence[float], ys: Sequence[float]) -> float:
    """(concordant - discordant) / sqrt((pairs - ties in x) * (pairs - ties in y)): 1 for the
    same order, -1 for the reverse, ties counted as tau-b does. NaN when either side is constant
    (there is no order to agree with)."""
    if len(xs) != len(ys):
        raise ValueError(f"kendall_tau_b: {len(xs)} scores for {len(ys)} lengths")
    agreement = untied_x = untied_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = _sign(xs[i] - xs[j]), _sign(ys[i] - ys[j])
            agreement += dx * dy
            untied_x += dx != 0
            untied_y += dy != 0
    if untied_x == 0 or untied_y == 0:
        return math.nan
    return agreement / math.sqrt(untied_x * untied_y)
