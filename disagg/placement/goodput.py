"""The goodput-aware policy: place each request on the (prefill, decode) pair predicted to serve
it with the most room against its SLOs, and refuse at once what no pair can serve in time.

Predictions count only the prompt tokens the prefill instance does not hold in its prefix
cache, so a request goes where its prefix is warm unless that instance is predicted to miss.
Headroom of a pair is the smaller of (SLO - predicted) / SLO over TTFT and TPOT (a target of 0
is no target). The pair with the most headroom wins. Pairs within `TIE` of the best (all of
them, for a request without targets) go by predicted TTFT + TPOT, predictions within
`LATENCY_TIE` of the fastest counting as equal, then by load; while any of them is predicted
on a guess (an instance not yet calibrated), by load alone. A request whose best headroom is
below what its priority needs is refused (or, with `best_effort`, placed anyway): a request that
will miss anyway only slows the others down (DistServe's goodput argument). Priorities shed in
order under pressure: sheddable needs a margin of `SHEDDABLE_MARGIN`, standard needs none,
critical is never refused on a prediction. Nor is any request while the cluster is idle: there
is nothing to shed, and a model that predicts too slow is only corrected by what it lets through.

The router runs this class on its live instances, the simulator on simulated ones.
"""

from __future__ import annotations

import math
from typing import TypeVar

from disagg.placement.policies import Choice, LeastOutstandingWork, RequestShape
from disagg.placement.predictor import DecodeSide, PrefillSide, tpot_ms, ttft_ms

SHEDDABLE_MARGIN = 0.2
TIE = 0.02
LATENCY_TIE = 0.1  # predictions closer than this (relative) are within the model's error
_REQUIRED_HEADROOM = {"critical": -math.inf, "standard": 0.0, "sheddable": SHEDDABLE_MARGIN}

P = TypeVar("P", bound=PrefillSide)
D = TypeVar("D", bound=DecodeSide)


class GoodputPolicy(LeastOutstandingWork):
    """`choose_pair` places by prediction; `choose_decode` (a retry when the chosen decode
    instance had no room after all) is least-work's."""

    def __init__(self, best_effort: bool = False):
        """`best_effort`: place a request no pair can serve in time instead of refusing it."""
        self.best_effort = best_effort

    def choose_pair(self, prefills: list[P], decodes: list[D], request: RequestShape) -> Choice | None:
        """None when a pool is empty. For a colocated pool pass the same list twice: a pair is
        then one instance (both predictions on it)."""
        colocated = prefills is decodes
        roomy = [d for d in decodes if d.free_blocks >= request.blocks_needed] or decodes
        pairs = [(p, p) for p in roomy] if colocated else [(p, d) for p in prefills for d in roomy]
        if not pairs:
            return None
        cached = {id(p): p.cached_tokens(request.block_hashes) for p, _ in pairs}
        ttfts = {id(p): ttft_ms(p, request.prompt_tokens, cached[id(p)]) for p, _ in pairs}
        tpots = {id(d): tpot_ms(d, request.prompt_tokens, request.max_tokens) for _, d in pairs}
        scored = [(request.slo.headroom(ttfts[id(p)], tpots[id(d)]), p, d) for p, d in pairs]
        best = max(h for h, _, _ in scored)
        close = [s for s in scored if _tied(s[0], best)]
        if all(_calibrated(p, d) for _, p, d in close):  # a guess orders nothing: then by load alone
            fastest = min(ttfts[id(p)] + tpots[id(d)] for _, p, d in close)
            close = [s for s in close if ttfts[id(s[1])] + tpots[id(s[2])] <= fastest * (1 + LATENCY_TIE)]
        headroom, prefill, decode = min(close, key=lambda s: _load(s[1], s[2]))
        guessed = not _calibrated(prefill, decode)  # a guess refuses nothing
        # Nothing is refused while the cluster is idle: there is no load to shed, and only what
        # it serves corrects a model that predicts too slow (refusing on it would refuse forever).
        idle = all(p.predicted_queue_tokens == 0 for p, _ in pairs) and all(d.decode_batch == 0 for _, d in pairs)
        admitted = self.best_effort or guessed or idle or headroom >= _REQUIRED_HEADROOM[request.priority]
        return Choice(prefill, decode, ttfts[id(prefill)], tpots[id(decode)], headroom, admitted, cached[id(prefill)])


def _calibrated(prefill, decode) -> bool:
    return prefill.prefill_calibrated and decode.decode_calibrated


def _tied(headroom: float, best: float) -> bool:
    if math.isinf(best):
        return math.isinf(headroom)
    return headroom >= best - TIE


def _load(prefill, decode) -> tuple:
    """Least outstanding work first: prompt tokens queued, then requests decoding."""
    return (prefill.predicted_queue_tokens, decode.decode_batch, prefill.instance_id, decode.instance_id)
