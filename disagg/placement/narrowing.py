"""Which instances of a pool the goodput policy predicts at all, where the pool is too large to
predict whole.

Predicting every instance costs a decision P + D predictions, and scoring every pair P x D: at
100+100 instances that is the router's time, not the request's. A pool of more than `candidates`
instances is narrowed to `candidates` of them: the `holders` holding the longest prefix of the
prompt (where it would be cheapest to prefill), the least loaded (prompt tokens queued on a
prefill instance, requests decoding on a decode one: what the predictions mostly turn on), and
`sampled` others drawn at random, so that an instance whose load hides that it is faster (another
model, a residual that shrank) is still looked at now and then. A pool of at most `candidates`
instances, and every pool with `candidates` 0, is predicted whole: the full search.

Finding the candidates reads each instance's load once (a number, no prediction): the cost of a
decision grows with P + D in cheap reads and stays bounded in predictions.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
DEFAULT_CANDIDATES = 12


@dataclass(frozen=True)
class Narrowing:
    candidates: int = DEFAULT_CANDIDATES  # instances predicted per pool at most; 0: all (the full search)
    holders: int = 2  # of them, at most this many holding the prompt's prefix (longest first)
    sampled: int = 2  # of them, this many drawn at random
    seed: int = 0  # of the draws: a simulation replays the same choices

    def __post_init__(self) -> None:
        for name in ("candidates", "holders", "sampled"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {value!r}")
        if self.candidates and self.holders + self.sampled >= self.candidates:
            raise ValueError(
                f"candidates: must exceed holders + sampled ({self.holders} + {self.sampled}) so that the least "
                f"loaded are among them, got {self.candidates} (0: every instance)"
            )

    def narrows(self, pool_size: int) -> bool:
        return 0 < self.candidates < pool_size

    def narrow(
        self, instances: Sequence[T], load: Callable, rng: random.Random, block_hashes=(), holders: bool = True
    ) -> list[T]:
        """The instances of a pool to predict, in the pool's order. `load` orders them (least
        first: `prefill_load`, `decode_load`, `colocated_load`); `block_hashes`, the prompt's:
        with `holders`, its prefix holders are among them. A prompt's first block also decides
        the rest (equal loads go in the pool's order from a point of its own, and the draws are
        its own), so that, as in the full search, a prefix cold everywhere lands where the next
        request with it looks; `rng` draws for a prompt without blocks."""
        if not self.narrows(len(instances)):
            return list(instances)
        if block_hashes:
            rng = random.Random(self.seed * 1_000_003 ^ block_hashes[0])
        start = rng.randrange(len(instances))
        held = self._holders(instances, block_hashes, load) if holders else []
        return self._pick(instances, load, held, rng, start)

    def _holders(self, instances: Sequence, block_hashes: Sequence[int], load: Callable) -> list[int]:
        """Indices of the instances with the longest cached prefix of the prompt, least loaded first."""
        if not self.holders or not block_hashes:
            return []
        first = block_hashes[:1]
        holding = [i for i, p in enumerate(instances) if p.cached_tokens(first)]  # a miss is one lookup
        if len(holding) > self.holders:
            cached = {i: instances[i].cached_tokens(block_hashes) for i in holding}
            holding = heapq.nsmallest(self.holders, holding, key=lambda i: (-cached[i], load(instances[i])))
        return holding

    def _pick(
        self, instances: Sequence[T], load: Callable, holders: list[int], rng: random.Random, start: int
    ) -> list[T]:
        """The holders, then the least loaded up to `candidates - sampled` (equal ones in the
        pool's order from `start` on), then `sampled` drawn."""
        chosen = set(holders)
        least = self.candidates - self.sampled - len(chosen)
        order = itertools.chain(range(start, len(instances)), range(start))
        ranked = heapq.nsmallest(least + len(chosen), order, key=lambda i: load(instances[i]))  # stable
        chosen.update([i for i in ranked if i not in chosen][:least])
        drawn = rng.sample(range(len(instances)), min(len(instances), self.sampled + len(chosen)))
        chosen.update([i for i in drawn if i not in chosen][: self.sampled])
        return [instances[i] for i in sorted(chosen)]


def prefill_load(instance) -> int:
    return instance.predicted_queue_tokens


def decode_load(instance) -> int:
    return instance.decode_batch


def colocated_load(instance) -> tuple[int, int]:
    return instance.predicted_queue_tokens, instance.decode_batch
