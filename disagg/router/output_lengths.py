"""How many tokens the router expects a request to write, for its TPOT prediction.

A joining request's TPOT depends on the batch's context over its life, which grows with what it
writes. `max_tokens` bounds that from above and is usually far above it (clients ask for room:
a chat answer of 60 tokens under max_tokens 1024), so predictions from it see contexts, and so
steps, longer than they will be. The output-length ranker (disagg.ranking, issue 39) predicts
the length from the prompt in microseconds, with no model call.

`ServingConfig.output_length`: max_tokens (the default) or ranker (its prediction, capped at
max_tokens; the engines' `length_ranker` file where one is set, else the bundled one).
"""

from __future__ import annotations

from collections.abc import Sequence

from disagg.config import ServingConfig
from disagg.ranking.ranker import DEFAULT_RANKER_FILE, LengthRanker


class OutputLengths:
    def __init__(self, ranker: LengthRanker | None = None, for_tpot: bool = False):
        self.ranker = ranker  # None: no request gets a predicted length
        self.for_tpot = for_tpot  # the TPOT prediction takes the predicted length (else max_tokens)

    @classmethod
    def from_config(cls, config: ServingConfig) -> "OutputLengths":
        """The ranker where the router's TPOT predictions take its lengths, or where the decode
        side admits by them (`scheduling_order: ltr`: disagg.router.decode_admission)."""
        for_tpot = config.output_length == "ranker"
        if not (for_tpot or decode_order(config) == "ltr"):
            return cls()
        return cls(LengthRanker.load(config.engine.length_ranker or DEFAULT_RANKER_FILE), for_tpot)

    def predicted(self, prompt_token_ids: Sequence[int], max_tokens: int) -> int | None:
        """The ranker's length for the request, at least 1 and at most its max_tokens; None
        without a ranker."""
        if self.ranker is None:
            return None
        return max(1, min(self.ranker.predict_len(prompt_token_ids), max_tokens))

    def expected(self, prompt_token_ids: Sequence[int], max_tokens: int) -> int:
        """Output tokens the TPOT prediction takes the request to write."""
        predicted = self.predicted(prompt_token_ids, max_tokens) if self.for_tpot else None
        return max_tokens if predicted is None else predicted


def decode_order(config: ServingConfig) -> str:
    """The scheduling order of the pool whose admission the router orders: the decode pool's
    (disaggregated), the colocated pool's otherwise (whose engines order their own queues)."""
    pool = config.decode if config.mode == "disaggregated" else config.colocated
    return config.pool_engine_config(pool).scheduling_order
