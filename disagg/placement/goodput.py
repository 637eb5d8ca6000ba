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

Conditional disaggregation (`local_prefill_max_tokens`): a short prompt may be prefilled by its
decode instance itself, as a chunk in the decode batch's step, when that is predicted faster by
more than the model's error than any disaggregated pair (no KV transfer, one hop less) and the
stall of the batch there keeps its TPOT (within the target; without one, within the model's error).

The router runs this class on its live instances, the simulator on simulated ones.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import TypeVar

from disagg.placement.policies import Choice, LeastOutstandingWork, RequestShape, Slo
from disagg.placement.predictor import DecodeSide, Predicted, PrefillSide, prefill_forecast, tpot, ttft

SHEDDABLE_MARGIN = 0.2
TIE = 0.02
LATENCY_TIE = 0.1  # predictions closer than this (relative) are within the model's error
_REQUIRED_HEADROOM = {"critical": -math.inf, "standard": 0.0, "sheddable": SHEDDABLE_MARGIN}

P = TypeVar("P", bound=PrefillSide)
D = TypeVar("D", bound=DecodeSide)


class GoodputPolicy(LeastOutstandingWork):
    """`choose_pair` places by prediction; `choose_decode` (a retry when the chosen decode
    instance had no room after all) is least-work's."""

    def __init__(self, best_effort: bool = False, local_prefill_max_tokens: int = 0):
        """`best_effort`: place a request no pair can serve in time instead of refusing it.
        `local_prefill_max_tokens`: a prompt with at most this many uncached tokens may be
        prefilled on its decode instance (conditional disaggregation; 0: never)."""
        self.best_effort = best_effort
        self.local_prefill_max_tokens = local_prefill_max_tokens

    def choose_pair(self, prefills: list[P], decodes: list[D], request: RequestShape) -> Choice | None:
        """None when a pool is empty. For a colocated pool pass the same list twice: a pair is
        then one instance (both predictions on it)."""
        colocated = prefills is decodes
        roomy = [d for d in decodes if d.free_blocks >= request.blocks_needed] or decodes
        pairs = [(p, p) for p in roomy] if colocated else [(p, d) for p in prefills for d in roomy]
        if not pairs:
            return None
        # each instance predicted once, though it is in many pairs
        prefill_side, decode_side = {id(p): p for p, _ in pairs}, {id(d): d for _, d in pairs}
        cached = {k: p.cached_tokens(request.block_hashes) for k, p in prefill_side.items()}
        ttfts = {k: ttft(p, request.prompt_tokens, cached[k]) for k, p in prefill_side.items()}
        tpots = {k: tpot(d, request.prompt_tokens, request.output_tokens) for k, d in decode_side.items()}
        wait_ms = 0.0 if colocated else request.decode_wait_ms
        scored = [_Option(p, d, ttfts[id(p)], tpots[id(d)], request.slo, cached[id(p)], _calibrated(p, d), wait_ms=wait_ms)
                  for p, d in pairs]  # fmt: skip
        if not colocated:
            scored += self._local_options(prefills, roomy, request, tpots)
        best = max(o.headroom for o in scored)
        # (A prediction that is not a number, from an instance that just broke, ties with nothing:
        # then every option stays in the running rather than none.)
        close = [o for o in scored if _tied(o.headroom, best)] or scored
        if all(o.calibrated for o in close):  # a guess orders nothing: then by load alone
            fastest = min(o.latency for o in close)
            close = [o for o in close if o.latency <= fastest * (1 + LATENCY_TIE)] or close
        # equal: the usual path first, then least work (the prompt tokens this one adds counted)
        chosen = min(close, key=lambda o: (o.local, _load(o, request)))
        guessed = not chosen.calibrated  # a guess refuses nothing
        # Nothing is refused while the cluster is idle: there is no load to shed, and only what
        # it serves corrects a model that predicts too slow (refusing on it would refuse forever).
        idle = all(p.predicted_queue_tokens == 0 for p, _ in pairs) and all(d.decode_batch == 0 for _, d in pairs)
        admitted = self.best_effort or guessed or idle or chosen.headroom >= _REQUIRED_HEADROOM[request.priority]
        return Choice(chosen.prefill, chosen.decode, chosen.ttft_ms, chosen.tpot_ms, chosen.headroom, admitted,
                      chosen.cached_tokens, chosen.local, chosen.ttft.model_ms, chosen.tpot.model_ms)  # fmt: skip

    def _local_options(self, prefills: list, decodes: list, request: RequestShape, tpots: dict) -> list[_Option]:
        """Conditional disaggregation: each decode instance prefilling the prompt itself, where
        the prompt is short (uncached tokens within the limit, one chunk) and the stall of the
        decode batch already there is allowed (`_stall_allowed`). Only on calibrated
        models: a decode instance that has not prefilled yet is predicted with the prefill
        pool's fitted prefill form (the same hardware and model; its own once it has one)."""
        fitted = [p for p in prefills if p.prefill_calibrated]
        if self.local_prefill_max_tokens <= 0 or not fitted:
            return []
        options = []
        for d in decodes:
            cached = d.cached_tokens(request.block_hashes)
            uncached = request.prompt_tokens - cached
            if not d.decode_calibrated or uncached > min(self.local_prefill_max_tokens, d.prefill_budget):
                continue
            model = replace(d.step_model, prefill=(d if d.prefill_calibrated else fitted[0]).step_model.prefill)
            steps = prefill_forecast(d, request.prompt_tokens, cached, model)  # mixed: the batch rides along
            step_ms = d.step_model.decode_ms(d.decode_batch, d.decode_context_tokens)
            if d.decode_batch and not _stall_allowed(steps.stall_ms(model), step_ms, request):
                continue
            local = ttft(d, request.prompt_tokens, cached, model)
            options.append(_Option(d, d, local, tpots[id(d)], request.slo, cached, True, True, request.decode_wait_ms))
        return options


@dataclass
class _Option:
    """One way to serve a request, with its predictions."""

    prefill: object
    decode: object
    ttft: Predicted
    tpot: Predicted
    slo: Slo
    cached_tokens: int
    calibrated: bool  # both predictions from fitted models (else a guess)
    local: bool = False
    wait_ms: float = 0.0  # for room on the decode side, before the KV moves

    @property
    def ttft_ms(self) -> float:
        return self.ttft.ms + self.wait_ms

    @property
    def tpot_ms(self) -> float:
        return self.tpot.ms

    @property
    def headroom(self) -> float:
        room = self.slo.headroom(self.ttft_ms, self.tpot_ms)
        return -math.inf if math.isnan(room) else room  # a prediction that is no number promises nothing

    @property
    def latency(self) -> float:
        total = self.ttft_ms + self.tpot_ms
        return math.inf if math.isnan(total) else total


def _stall_allowed(stall_ms: float, step_ms: float, request: RequestShape) -> bool:
    """The chunk delays every token of the batch at that instance once (by `stall_ms`); spread
    over their remaining tokens (taken as half this request's, as the TPOT prediction takes
    contexts), it must keep their TPOT within the target, or with no target, within the model's
    error."""
    added = stall_ms / max(1, request.output_tokens // 2)
    if request.slo.tpot_ms > 0:
        return step_ms + added <= request.slo.tpot_ms
    return added <= LATENCY_TIE * step_ms


def _calibrated(prefill, decode) -> bool:
    return prefill.prefill_calibrated and decode.decode_calibrated


def _tied(headroom: float, best: float) -> bool:
    if math.isinf(best):
        return math.isinf(headroom)
    return headroom >= best - TIE


def _load(option: _Option, request: RequestShape) -> tuple:
    """Least outstanding work first: prompt tokens to compute (the queue and this prompt's
    uncached ones: its prefix counts even on a guessed model), then requests decoding. Equal
    work goes by rendezvous hashing of the prompt's first block: a prefix cold everywhere
    lands where the next request with it will look, and different prefixes spread."""
    prefill, decode = option.prefill, option.decode
    work = prefill.predicted_queue_tokens + request.prompt_tokens - option.cached_tokens
    first = request.block_hashes[0] if request.block_hashes else 0
    spread = zlib.crc32(f"{first}:{prefill.instance_id}:{decode.instance_id}".encode())
    return (work, decode.decode_batch, spread)
