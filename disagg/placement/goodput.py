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
Decode-side reuse (`decode_reuse_max_tokens`, on by default) is the same option for a decode
instance that holds a longer prefix of the prompt than every prefill candidate (a conversation's
history: its last answer's KV is only there), for at most that many uncached tokens.

At scale the policy predicts only some instances of a large pool (disagg.placement.narrowing:
the prompt's prefix holders, the least loaded, a few drawn at random), and of the pairs of those
it scores only the ones that can be chosen: a pair's headroom and latency are made of its two
instances' own, so the pairs tied for the best are known from each side alone. A pool of at most
`Narrowing.candidates` instances is predicted whole, and the choice is the full search's.

The router runs this class on its live instances, the simulator on simulated ones.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TypeVar

from disagg.placement.narrowing import Narrowing, colocated_load, decode_load, prefill_load
from disagg.placement.policies import Choice, LeastOutstandingWork, RequestShape
from disagg.placement.predictor import DecodeSide, Predicted, PrefillSide, prefill_forecast, tpot, ttft
from disagg.slo import SLO

SHEDDABLE_MARGIN = 0.2
TIE = 0.02
LATENCY_TIE = 0.1  # predictions closer than this (relative) are within the model's error
_REQUIRED_HEADROOM = {"critical": -math.inf, "standard": 0.0, "sheddable": SHEDDABLE_MARGIN}

P = TypeVar("P", bound=PrefillSide)
D = TypeVar("D", bound=DecodeSide)


class GoodputPolicy(LeastOutstandingWork):
    """`choose_pair` places by prediction; `choose_decode` (a retry when the chosen decode
    instance had no room after all) is least-work's."""

    def __init__(
        self,
        best_effort: bool = False,
        local_prefill_max_tokens: int = 0,
        narrowing: Narrowing | None = None,
        decode_reuse_max_tokens: int = 0,
    ):
        """`best_effort`: place a request no pair can serve in time instead of refusing it.
        `local_prefill_max_tokens`: a prompt with at most this many uncached tokens may be
        prefilled on its decode instance (conditional disaggregation; 0: never).
        `decode_reuse_max_tokens`: so may one on a decode instance holding more of its prefix
        than every prefill candidate (decode-side reuse; 0: never).
        `narrowing`: which instances of a large pool are predicted (disagg.placement.narrowing;
        by default at most 12 a pool; `Narrowing(candidates=0)`: all)."""
        self.best_effort = best_effort
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.decode_reuse_max_tokens = decode_reuse_max_tokens
        self.narrowing = narrowing if narrowing is not None else Narrowing()
        self._rng = random.Random(self.narrowing.seed)

    def choose_pair(self, prefills: list[P], decodes: list[D], request: RequestShape) -> Choice | None:
        """None when a pool is empty. For a colocated pool pass the same list twice: a pair is
        then one instance (both predictions on it)."""
        colocated = prefills is decodes
        roomy = [d for d in decodes if d.free_blocks >= request.blocks_needed] or decodes
        if not roomy or not prefills:
            return None
        scored = self._colocated_options(roomy, request) if colocated else self._pair_options(prefills, roomy, request)
        chosen = _pick(scored, request)
        guessed = not chosen.calibrated  # a guess refuses nothing
        # Nothing is refused while the cluster is idle: there is no load to shed, and only what
        # it serves corrects a model that predicts too slow (refusing on it would refuse forever).
        idle = all(p.predicted_queue_tokens == 0 for p in (roomy if colocated else prefills)) and all(
            d.decode_batch == 0 for d in roomy
        )
        admitted = self.best_effort or guessed or idle or chosen.headroom >= _REQUIRED_HEADROOM[request.priority]
        return Choice(chosen.prefill, chosen.decode, chosen.ttft_ms, chosen.tpot_ms, chosen.headroom, admitted,
                      chosen.cached_tokens, chosen.local, chosen.ttft.model_ms, chosen.tpot.model_ms)  # fmt: skip

    def _colocated_options(self, instances: list, request: RequestShape) -> list[_Option]:
        candidates = self.narrowing.narrow(instances, colocated_load, self._rng, request.block_hashes)
        options = []
        for i in candidates:
            cached = i.cached_tokens(request.block_hashes)
            predicted = ttft(i, request.prompt_tokens, cached), tpot(i, request.prompt_tokens, request.output_tokens)
            options.append(_Option(i, i, *predicted, request.slo, cached, _calibrated(i, i)))
        return options

    def _pair_options(self, prefills: list, decodes: list, request: RequestShape) -> list[_Option]:
        """Each candidate instance predicted once, though it is in many pairs; of the pairs, those
        that can be chosen (`_pairs_worth_scoring`), then the local options."""
        # A decode instance's prefix counts only where it may prefill a prompt itself: then the
        # one holding a conversation's history (the prefix index lists it) is a candidate.
        decode_holders = self.local_prefill_max_tokens > 0 or self.decode_reuse_max_tokens > 0
        sides = _Sides.predict(
            self.narrowing.narrow(prefills, prefill_load, self._rng, request.block_hashes),
            self.narrowing.narrow(decodes, decode_load, self._rng, request.block_hashes, holders=decode_holders),
            request,
        )
        local = self._local_options(prefills, sides.decodes, request, sides.tpots, max(sides.cached, default=0))
        pairs = [sides.option(i, j, request) for i, j in _pairs_worth_scoring(sides, local, request)]
        return pairs + local

    def _local_options(
        self, prefills: list, decodes: list, request: RequestShape, tpots: list, prefill_cached: int
    ) -> list[_Option]:
        """Conditional disaggregation and decode-side reuse: each decode instance prefilling the
        prompt itself, where the prompt is short (uncached tokens within its limit, one chunk)
        and the stall of the decode batch already there is allowed (`_stall_allowed`). Only on
        calibrated models: a decode instance that has not prefilled yet is predicted with the
        prefill pool's fitted prefill form (the same hardware and model; its own once it has
        one). `prefill_cached`: the longest prefix a prefill candidate holds."""
        if self.local_prefill_max_tokens <= 0 and self.decode_reuse_max_tokens <= 0:
            return []
        fitted = next((p for p in prefills if p.prefill_calibrated), None)
        if fitted is None:
            return []
        options = []
        for d, decode_tpot in zip(decodes, tpots):
            cached = d.cached_tokens(request.block_hashes)
            uncached = request.prompt_tokens - cached
            limit = self._local_limit(cached, prefill_cached)
            if not d.decode_calibrated or uncached > min(limit, d.prefill_budget):
                continue
            model = replace(d.step_model, prefill=(d if d.prefill_calibrated else fitted).step_model.prefill)
            steps = prefill_forecast(d, request.prompt_tokens, cached, model)  # mixed: the batch rides along
            step_ms = d.step_model.decode_ms(d.decode_batch, d.decode_context_tokens)
            if d.decode_batch and not _stall_allowed(steps.stall_ms(model), step_ms, request):
                continue
            local = _waited(ttft(d, request.prompt_tokens, cached, model), request)
            options.append(_Option(d, d, local, decode_tpot, request.slo, cached, calibrated=True, local=True))
        return options

    def _local_limit(self, cached: int, prefill_cached: int) -> int:
        """The uncached tokens a decode instance holding `cached` of the prompt may prefill."""
        reuse = self.decode_reuse_max_tokens if cached > prefill_cached else 0
        return max(self.local_prefill_max_tokens, reuse)


def _waited(predicted: Predicted, request: RequestShape) -> Predicted:
    """A disaggregated option's TTFT, with the request's wait for decode room (the same for all)."""
    return replace(predicted, wait_ms=request.decode_wait_ms) if request.decode_wait_ms else predicted


def _pick(scored: list[_Option], request: RequestShape) -> _Option:
    """The option with the most headroom; among those tied, the fastest, then the least loaded."""
    best = max(o.headroom for o in scored)
    # (A prediction that is not a number, from an instance that just broke, ties with nothing:
    # then every option stays in the running rather than none.)
    close = [o for o in scored if _tied(o.headroom, best)] or scored
    if all(o.calibrated for o in close):  # a guess orders nothing: then by load alone
        fastest = min(o.latency for o in close)
        close = [o for o in close if o.latency <= fastest * (1 + LATENCY_TIE)] or close
    # equal: the usual path first, then least work (the prompt tokens this one adds counted)
    return min(close, key=lambda o: (o.local, _load(o, request)))


@dataclass
class _Sides:
    """The candidates of each pool, each with its own predictions: a pair's are its two instances'."""

    prefills: list
    decodes: list
    cached: list[int]
    ttfts: list[Predicted]
    tpots: list[Predicted]

    @classmethod
    def predict(cls, prefills: list, decodes: list, request: RequestShape) -> _Sides:
        cached = [p.cached_tokens(request.block_hashes) for p in prefills]
        ttfts = [_waited(ttft(p, request.prompt_tokens, c), request) for p, c in zip(prefills, cached)]
        tpots = [tpot(d, request.prompt_tokens, request.output_tokens) for d in decodes]
        return cls(prefills, decodes, cached, ttfts, tpots)

    def option(self, i: int, j: int, request: RequestShape) -> _Option:
        p, d = self.prefills[i], self.decodes[j]
        return _Option(p, d, self.ttfts[i], self.tpots[j], request.slo, self.cached[i], _calibrated(p, d))


def _pairs_worth_scoring(sides: _Sides, local: list[_Option], request: RequestShape) -> list[tuple[int, int]]:
    """The (prefill, decode) index pairs among which `_pick` (with the local options) chooses as
    it would among all of them, in their order: a pair's headroom is the smaller of its prefill's
    TTFT room and its decode's TPOT room, and its latency their sum, so the pairs tied for the best
    headroom are every tied prefill with every tied decode, and the fastest of them pairs the
    fastest of each. Kept: a pair with the best headroom, one with a guessed prediction if any
    ties (then `_pick` orders by load alone), the fastest, and of the least loaded within the
    latency tie, the one `_pick` takes (`_least_spread`). With a prediction that is no number, all
    pairs."""
    ttft_ms, tpot_ms = [t.ms for t in sides.ttfts], [t.ms for t in sides.tpots]
    if not all(map(math.isfinite, ttft_ms + tpot_ms)):
        return list(itertools.product(range(len(ttft_ms)), range(len(tpot_ms))))
    p_room, d_room = [request.slo.ttft_room(t) for t in ttft_ms], [request.slo.tpot_room(t) for t in tpot_ms]
    top = max(range(len(p_room)), key=p_room.__getitem__), max(range(len(d_room)), key=d_room.__getitem__)
    best = max([min(p_room[top[0]], d_room[top[1]]), *(o.headroom for o in local)])
    tied_p = [i for i, room in enumerate(p_room) if _tied(room, best)]
    tied_d = [j for j, room in enumerate(d_room) if _tied(room, best)]
    keep = {top}
    if not tied_p or not tied_d:  # no pair ties with a local option's headroom
        return sorted(keep)
    guessed_p = [i for i in tied_p if not sides.prefills[i].prefill_calibrated][:1]
    guessed_d = [j for j in tied_d if not sides.decodes[j].decode_calibrated][:1]
    keep.update((i, tied_d[0]) for i in guessed_p)
    keep.update((tied_p[0], j) for j in guessed_d)
    work = {i: sides.prefills[i].predicted_queue_tokens + request.prompt_tokens - sides.cached[i] for i in tied_p}
    batch = {j: sides.decodes[j].decode_batch for j in tied_d}
    if guessed_p or guessed_d:  # by load alone
        keep.update(itertools.product(_least(tied_p, work), _least(tied_d, batch)))
        return sorted(keep)
    fast = min(tied_p, key=ttft_ms.__getitem__), min(tied_d, key=tpot_ms.__getitem__)
    keep.add(fast)
    local_tied = [o.latency for o in local if _tied(o.headroom, best)]
    bound = min([ttft_ms[fast[0]] + tpot_ms[fast[1]], *local_tied]) * (1 + LATENCY_TIE)
    within_p = _least([i for i in tied_p if ttft_ms[i] + tpot_ms[fast[1]] <= bound], work)
    if within_p:
        lead = min(ttft_ms[i] for i in within_p)
        within_d = _least([j for j in tied_d if lead + tpot_ms[j] <= bound], batch)
        block = ((i, j) for i in within_p for j in within_d if ttft_ms[i] + tpot_ms[j] <= bound)
        keep.update(_least_spread(block, sides, request))
    return sorted(keep)


def _least_spread(pairs, sides: _Sides, request: RequestShape) -> list[tuple[int, int]]:
    """Of `pairs` (in order), all of equal work and batch and within the latency tie, the one
    `_pick` would take: the first with the least rendezvous hash (`_load`'s `spread`). Scoring
    them all instead costs an option a pair: in a large idle pool, every pair of it."""
    first = request.block_hashes[0] if request.block_hashes else 0
    heads = {}  # crc32 of "first:prefill_id:", each prefill's once (crc32 runs on: crc32(b, crc32(a)) == crc32(a + b))
    tails = {}
    best, least = None, None
    for i, j in pairs:
        head = heads.get(i)
        if head is None:
            head = heads[i] = zlib.crc32(f"{first}:{sides.prefills[i].instance_id}:".encode())
        tail = tails.get(j)
        if tail is None:
            tail = tails[j] = f"{sides.decodes[j].instance_id}".encode()
        spread = zlib.crc32(tail, head)
        if least is None or spread < least:
            best, least = (i, j), spread
    return [] if best is None else [best]


def _least(indices: list[int], load: dict[int, int]) -> list[int]:
    """Those of `indices` with the least `load`."""
    if not indices:
        return []
    least = min(load[i] for i in indices)
    return [i for i in indices if load[i] == least]


@dataclass
class _Option:
    """One way to serve a request, with its predictions."""

    prefill: object
    decode: object
    ttft: Predicted
    tpot: Predicted
    slo: SLO
    cached_tokens: int
    calibrated: bool  # both predictions from fitted models (else a guess)
    local: bool = False

    @property
    def ttft_ms(self) -> float:
        return self.ttft.ms

    @property
    def tpot_ms(self) -> float:
        return self.tpot.ms

    @cached_property  # read a few times by `_pick`
    def headroom(self) -> float:
        room = self.slo.headroom(self.ttft_ms, self.tpot_ms)
        return -math.inf if math.isnan(room) else room  # a prediction that is no number promises nothing

    @cached_property
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
