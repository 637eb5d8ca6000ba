"""Predicted output lengths for a replayed workload: what a pool under `scheduling_order: ltr`
orders by (issue 39). A replay with exact predictions shows the best ltr can do; one with a
noisy oracle shows how much of that a ranker of a given quality keeps.

Pure Python, deterministic: the same seed gives every request the same prediction, whatever
order the requests are asked in.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import replace

from disagg.planner.workload import SimRequest

Predictor = Callable[[SimRequest], int]


def with_predicted_lengths(requests: Iterable[SimRequest], predict: Predictor) -> list[SimRequest]:
    """The same requests, each carrying `predict(request)` as its predicted output length."""
    return [replace(r, predicted_output_len=predict(r)) for r in requests]


def exact_lengths(request: SimRequest) -> int:
    """A perfect ranker: the length the request will output."""
    return request.output_len


def noisy_oracle(sigma: float, seed: int = 0) -> Predictor:
    """The true output length times lognormal noise (median 1, `sigma` of its log): sigma 0 is
    exact; around 1 a prediction is often off by a factor of 2-3, and pairs of requests whose
    lengths differ less than that are often ranked the wrong way round."""
    if sigma < 0:
        raise ValueError(f"sigma: must be >= 0, got {sigma!r}")

    def predict(request: SimRequest) -> int:
        # Seeded by the request, not by a shared stream, so a prediction does not depend on
        # which requests were predicted before it.
        noise = random.Random(f"{seed}:{request.index}").lognormvariate(0.0, sigma)
        return max(1, round(request.output_len * noise))

    return predict
