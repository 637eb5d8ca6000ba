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
    def __init__(self, ranker: LengthRanker | None = None):
        self.ranker = ranker  # None: max_tokens is what is expected

    @classmethod
    def from_config(cls, config: ServingConfig) -> "OutputLengths":
        if config.output_length != "ranker":
            return cls()
        return cls(LengthRanker.load(config.engine.length_ranker or DEFAULT_RANKER_FILE))

    def expected(self, prompt_token_ids: Sequence[int], max_tokens: int) -> int:
        """Output tokens expected of a request, at most its max_tokens."""
        if self.ranker is None:
            return max_tokens
        return max(1, min(self.ranker.predict_len(prompt_token_ids), max_tokens))
