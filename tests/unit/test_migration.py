"""What a migrating request asks of its next attempt, and how its deltas are counted (pure)."""

from __future__ import annotations

from disagg.request import SamplingParams
from disagg.router.migration import Progress
from disagg.rpc.messages import TokenDelta


def test_before_any_token_the_attempt_is_the_request_itself():
    params = SamplingParams(temperature=0.0, max_tokens=8)
    progress = Progress([1, 2, 3], params)
    assert progress.attempt_prompt() == [1, 2, 3]
    assert progress.attempt_params() is params
    assert progress.attempt_id("r") == "r"


def test_after_tokens_the_next_attempt_asks_only_for_the_rest_and_counts_as_the_whole():
    progress = Progress([1, 2, 3], SamplingParams(temperature=0.7, seed=5, max_tokens=8))
    progress.record(TokenDelta("r", [10]))
    progress.record(TokenDelta("r", [11, 12]))
    progress.migrations = 1
    assert progress.attempt_id("r") == "r~1", "workers see each attempt under its own id"
    assert progress.attempt_prompt() == [1, 2, 3, 10, 11, 12]
    params = progress.attempt_params()
    assert (params.max_tokens, params.resumed_tokens, params.seed) == (5, 3, 5)
    delta = progress.record(TokenDelta("r", [13], num_prompt_tokens=6, num_output_tokens=1))
    assert (delta.num_prompt_tokens, delta.num_output_tokens) == (3, 4)
    assert progress.params.max_tokens == 8, "the request's own params are left alone"
