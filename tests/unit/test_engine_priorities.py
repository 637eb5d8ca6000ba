"""Priorities through the engine's API, as vLLM users call it: `LLM.generate(..., priority=[...])`
and `add_request(..., priority=...)`, lower first, or by our names."""

from __future__ import annotations

import pytest
from support import random_prompts

from disagg import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    # One request at a time: the order they run in is the order they were scheduled in.
    return LLM(model="random:tiny", dtype="float32", num_kv_blocks=32, max_model_len=64, max_num_seqs=1)


def _prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in random_prompts([6] * n, 512, seed=3)]


def _run_order(outputs) -> list[int]:
    """Indexes of the outputs (input order) in the order their requests were first scheduled."""
    return sorted(range(len(outputs)), key=lambda i: outputs[i].metrics.first_scheduled)


@pytest.mark.parametrize(
    "priority",
    [["sheddable", "standard", "critical", "standard"], [1, 0, -1, 0]],
    ids=["names", "vllm-integers"],
)
def test_generate_runs_the_critical_prompt_first_and_equals_in_order(llm, priority):
    outputs = llm.generate(_prompts(4), PARAMS, use_tqdm=False, priority=priority)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3] * 4  # results still in input order
    assert _run_order(outputs) == [2, 1, 3, 0]


def test_generate_without_priorities_is_first_come_first_served(llm):
    assert _run_order(llm.generate(_prompts(3), PARAMS, use_tqdm=False)) == [0, 1, 2]


def test_a_bad_priority_is_refused_before_any_prompt_is_added(llm):
    with pytest.raises(ValueError, match="priority"):
        llm.generate(_prompts(2), PARAMS, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="priority"):
        llm.generate(_prompts(2), PARAMS, use_tqdm=False, priority=[0, "urgent"])
    assert not llm.engine.has_unfinished_requests()


def test_add_request_keeps_the_priority_and_the_config_reaches_the_scheduler():
    llm = LLM(model="random:tiny", dtype="float32", num_kv_blocks=8, scheduling_order="ltr", priority_aging_s=2.5)
    scheduler = llm.engine.scheduler
    assert (scheduler.order, scheduler.priority_aging_s) == ("ltr", 2.5)
    request = llm.engine.add_request("r", prompt_token_ids=[1, 2, 3], sampling_params=PARAMS, priority="critical")
    assert request.priority == -1
    llm.engine.abort_request("r")
