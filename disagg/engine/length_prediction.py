"""Each request's predicted output length, for `scheduling_order: ltr` (disagg.engine.queue_order).

The engine asks a `LengthRanker` (disagg.ranking) when a request is made, so that every way a
request enters an engine (added, reserved for a remote prefill, migrated in) carries one. Under
fcfs nothing is loaded and nothing is predicted: the order does not read it.
"""

from __future__ import annotations

from disagg.config import EngineConfig
from disagg.errors import InvalidRequestError
from disagg.ranking.ranker import DEFAULT_RANKER_FILE, LengthRanker
from disagg.request import Request


def load_length_ranker(config: EngineConfig) -> LengthRanker | None:
    """The configured ranker (the bundled one when none is named) under ltr; None under fcfs."""
    if config.scheduling_order != "ltr":
        return None
    try:
        return LengthRanker.load(config.length_ranker or DEFAULT_RANKER_FILE)
    except ValueError as e:
        raise InvalidRequestError("length_ranker", str(e)) from None


def predict_output_len(ranker: LengthRanker, request: Request) -> int:
    """The ranker's length, no more than the request may output (its max_tokens)."""
    return min(ranker.predict_len(request.prompt_token_ids), request.sampling_params.max_tokens)
