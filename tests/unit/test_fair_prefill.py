"""Fair prefill (issue 40, item 4): a long prompt's chunks no longer take every step's budget
from the short prompts behind it, and the long one still finishes. Pure: the scheduler with a
fake runner (tests/unit/test_scheduler.py's, which checks the budget and blocks every step)."""

from __future__ import annotations

import itertools
import math

import pytest

from disagg.config import EngineConfig
from disagg.engine.block_manager import BlockManager
from disagg.engine.scheduler import Scheduler
from disagg.errors import InvalidRequestError
from disagg.request import PRIORITY_VALUES, Request, SamplingParams
from disagg.step_work import chunk_work, tokens_within_work
from tests.unit.test_scheduler import BLOCK, run_fake_step

BUDGET = 64  # a quarter of it, 16, is the default cap
CRITICAL, STANDARD, SHEDDABLE = (PRIORITY_VALUES[n] for n in ("critical", "standard", "sheddable"))
_first_tokens = itertools.count(0, 10_000)  # every prompt its own tokens: no prefix cache hits


def prompt(rid: str, length: int, max_tokens: int = 4, priority: int = STANDARD) -> Request:
    first = next(_first_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(first, first + length)), params, priority=priority)


def scheduler(**kw) -> Scheduler:
    kw.setdefault("max_num_batched_tokens", BUDGET)
    return Scheduler(BlockManager(2048, BLOCK), max_model_len=4096, **kw)


def started_long(s: Scheduler, length: int = 2000, steps: int = 2) -> Request:
    """A long prompt already a few chunks in, as the short ones arrive."""
    long = prompt("long", length)
    s.add_request(long)
    for _ in range(steps):
        run_fake_step(s)
    assert 0 < long.num_computed_tokens < length
    return long


def steps_to_first_token(s: Scheduler, requests: list[Request], limit: int = 1000) -> dict[str, int]:
    """Run steps until every one of `requests` has its first token: on which step each got it."""
    got: dict[str, int] = {}
    for step in range(1, limit + 1):
        run_fake_step(s)
        got.update({r.request_id: step for r in requests if r.num_output_tokens and r.request_id not in got})
        if len(got) == len(requests):
            return got
    raise AssertionError(f"only {sorted(got)} got a first token in {limit} steps")


def test_a_short_prompt_behind_a_started_long_one_finishes_its_prefill_in_its_first_step():
    s = scheduler()
    started_long(s)
    short = prompt("short", 40)
    s.add_request(short)
    out = run_fake_step(s)
    # Both capped at 16 first; the 32 left go first to the prompt they finish, the short one's 24;
    # a step that finishes a prompt gives the long one only its cap (the short one's TTFT is
    # that step's time). The next step, finishing nothing, gives the long one the whole budget.
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("long", 16), ("short", 40)]
    assert short.num_output_tokens == 1
    out = run_fake_step(s)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks if not c.generates] == [("long", 63)]


def test_six_short_prompts_behind_a_long_one_get_their_first_token_within_a_bounded_number_of_steps():
    fair, fcfs = scheduler(), scheduler(long_prefill_token_threshold=0)
    waits = {}
    for name, s in (("fair", fair), ("fcfs", fcfs)):
        started_long(s)
        shorts = [prompt(f"s{i}", 30) for i in range(6)]
        for r in shorts:
            s.add_request(r)
        waits[name] = steps_to_first_token(s, shorts)
    # 180 short tokens at >= 48 of every 64-token step (the long one's cap is 16): 4 steps. Without
    # the cap they wait for the long prompt's ~29 remaining steps.
    assert max(waits["fair"].values()) <= math.ceil(6 * 30 / (BUDGET - BUDGET // 4))
    assert min(waits["fcfs"].values()) > 25


def test_the_long_prompt_still_finishes_while_short_ones_keep_coming():
    s = scheduler()
    long = started_long(s, length=1000, steps=1)
    # A new short prompt every step, more than the budget can take after the long one's cap.
    shorts = itertools.count()
    for step in range(1, 200):
        for _ in range(4):
            s.add_request(prompt(f"s{next(shorts)}", 20, max_tokens=1))
        out = run_fake_step(s)
        assert any(c.request is long for c in out.chunks) or long.num_output_tokens
        if long.num_output_tokens:
            break
    # Its cap every step at least: 1000 tokens / 16.
    assert long.num_output_tokens == 1 and step <= math.ceil(1000 / (BUDGET // 4))


def test_threshold_0_is_first_come_first_served():
    s = scheduler(long_prefill_token_threshold=0)
    long = started_long(s, length=1000)
    short = prompt("short", 40)
    s.add_request(short)
    while long.num_tokens - long.num_computed_tokens > BUDGET:  # the long prompt alone, the whole budget
        out = run_fake_step(s)
        assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("long", BUDGET)]
    assert short.num_computed_tokens < short.num_prompt_tokens  # it waited for the long one


def test_a_threshold_at_or_above_the_budget_is_no_cap():
    assert scheduler(long_prefill_token_threshold=BUDGET).chunk_cap == BUDGET
    assert scheduler(long_prefill_token_threshold=10 * BUDGET).chunk_cap == BUDGET
    assert scheduler(long_prefill_token_threshold=0).chunk_cap == BUDGET
    assert scheduler().chunk_cap == BUDGET // 4
    assert scheduler(long_prefill_token_threshold=5).chunk_cap == 5


def test_decodes_still_go_first():
    s = scheduler()
    decoding = prompt("decoding", 8, max_tokens=50)
    s.add_request(decoding)
    run_fake_step(s)
    started_long(s)
    s.add_request(prompt("short", 40))
    out = run_fake_step(s)
    assert out.chunks[0].request is decoding and out.chunks[0].num_new_tokens == 1
    assert out.num_batched_tokens == 1 + BUDGET // 4 + 40  # the decode, the long one's cap, the short one


def test_a_better_priority_still_comes_first():
    s = scheduler(max_num_batched_tokens=32)  # cap 8
    started_long(s)
    sheddable, critical = prompt("sheddable", 24, priority=SHEDDABLE), prompt("critical", 24, priority=CRITICAL)
    s.add_request(sheddable)  # first in the queue
    s.add_request(critical)
    got = steps_to_first_token(s, [critical, sheddable])
    # The critical one gets the budget the caps left before the others (and the standard long
    # one before the sheddable one): it is through a step earlier.
    assert got == {"critical": 2, "sheddable": 3}


def test_a_better_priority_gets_its_share_first_when_the_budget_is_short():
    s = scheduler(max_num_batched_tokens=32)  # cap 8
    started_long(s)
    for i in range(3):
        s.add_request(prompt(f"sheddable{i}", 100, priority=SHEDDABLE))
    s.add_request(prompt("critical", 100, priority=CRITICAL))
    out = run_fake_step(s)
    # The long one's share, then the critical one's (waiting in priority order), then sheddable ones'.
    assert [c.request.request_id for c in out.chunks][:2] == ["long", "critical"]


@pytest.mark.parametrize("threshold", [-1, -512])
def test_a_negative_threshold_is_refused(threshold):
    with pytest.raises(ValueError):
        EngineConfig(long_prefill_token_threshold=threshold)
    with pytest.raises(ValueError):
        scheduler(long_prefill_token_threshold=threshold)


def test_the_config_default_is_a_quarter_of_the_budget_and_0_is_allowed():
    assert EngineConfig().long_prefill_token_threshold is None
    assert EngineConfig(long_prefill_token_threshold=0).long_prefill_token_threshold == 0
    with pytest.raises(InvalidRequestError):
        EngineConfig(long_prefill_token_threshold=True)


# ---- caps by work: a chunk deep in a long prompt carries fewer tokens -------------------------
CONTEXT = 256  # attention_context_tokens: a token at context 256 costs two at a prompt's start


def prompt_steps(s: Scheduler, request: Request) -> list[tuple[int, int]]:
    """(start, tokens) of each of `request`'s chunks until its first token."""
    spans = []
    while not request.num_output_tokens:
        out = run_fake_step(s)
        spans += [(c.start, c.num_new_tokens) for c in out.chunks if c.request is request]
    return spans


def test_a_long_prompts_steps_keep_within_a_whole_budgets_work_at_its_start():
    s = scheduler(attention_context_tokens=CONTEXT)
    long = prompt("long", 2000)
    s.add_request(long)
    spans = prompt_steps(s, long)
    whole = chunk_work(0, BUDGET, CONTEXT)
    assert spans[0] == (0, BUDGET), "at its start a step is as long as before (its cap, then the rest)"
    assert all(chunk_work(start, n, CONTEXT) <= whole for start, n in spans)
    assert all(chunk_work(start, n + 1, CONTEXT) > whole for start, n in spans[:-1]), "and no shorter"
    assert spans[-1][1] < 16, "deep in it, fewer tokens than even the token cap"
    assert sum(n for _, n in spans) == 2000
    # By tokens alone it takes the whole budget every step.
    by_tokens = scheduler()
    plain = prompt("plain", 2000)
    by_tokens.add_request(plain)
    assert {n for _, n in prompt_steps(by_tokens, plain)[1:-1]} == {BUDGET}


def test_a_short_prompt_behind_a_deep_long_one_shares_a_step_of_a_capped_work():
    s = scheduler(attention_context_tokens=CONTEXT)
    long = started_long(s, length=2000, steps=30)
    depth = long.num_computed_tokens
    short = prompt("short", 20)
    s.add_request(short)
    out = run_fake_step(s)
    long_n = next(c.num_new_tokens for c in out.chunks if c.request is long)
    assert short.num_output_tokens == 1
    # The long one's first share is the work of the 16-token cap at a prompt's start.
    assert long_n == tokens_within_work(depth, chunk_work(0, 16, CONTEXT), CONTEXT) < 16


def test_work_caps_are_fair_prefills_only():
    s = scheduler(attention_context_tokens=CONTEXT, long_prefill_token_threshold=0)
    long = prompt("long", 2000)
    s.add_request(long)
    assert {n for _, n in prompt_steps(s, long)[:-1]} == {BUDGET}


@pytest.mark.parametrize("context", [None, 1.0, 256.0, 3072.0])
def test_tokens_within_work_is_the_most_that_fit(context):
    for start in (0, 1, 100, 5000):
        for work in (0.5, 1.0, 16.0, 300.0):
            n = tokens_within_work(start, work, context)
            assert chunk_work(start, n, context) <= work < chunk_work(start, n + 1, context)


def test_long_prefill_by_work_is_a_boolean():
    assert EngineConfig().long_prefill_by_work is True
    assert EngineConfig(long_prefill_by_work=False).long_prefill_by_work is False
    with pytest.raises(InvalidRequestError, match="long_prefill_by_work"):
        EngineConfig(long_prefill_by_work="yes")
