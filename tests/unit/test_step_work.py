"""One description of a step's work (disagg.step_work): the engine, the model runner, the
profiler and the simulator describe the same step the same way, and a step report survives its
trip through the registry's list format."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from disagg.config import EngineConfig
from disagg.engine.block_manager import BlockManager
from disagg.engine.engine import LLMEngine
from disagg.engine.model_runner import is_decode
from disagg.engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from disagg.planner.simulator import SimInstance
from disagg.profiling.profiler import StepBench
from disagg.request import Request, SamplingParams
from disagg.step_work import Chunk, MeasuredStep, StepWork, computes_as_decode

BLOCK = 4
PREFIX = list(range(10, 18))  # two full blocks
# After the setup below: "decoding" (a 5-token prompt and one token out) computes its 6th token;
# "cached" (PREFIX + 1) has 8 tokens cached and computes its last prompt token, one token after
# known ones: a decode; "single" is a 1-token prompt at position 0: a chunk; "long" a whole prompt.
EXPECTED = StepWork(chunks=(Chunk(0, 1), Chunk(0, 6)), num_decodes=2, decode_context_sum=6 + 9)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_one_new_token_after_known_ones_is_a_decode_and_a_first_token_is_a_chunk():
    assert computes_as_decode(start=8, num_new_tokens=1) and computes_as_decode(start=1, num_new_tokens=1)
    assert not computes_as_decode(start=0, num_new_tokens=1) and not computes_as_decode(start=8, num_new_tokens=2)
    work = StepWork.of([(5, 1), (0, 1), (8, 1), (24, 16), (3, 0)])
    assert work == StepWork((Chunk(0, 1), Chunk(24, 16)), 2, 6 + 9)
    assert (work.kind, work.prefill_tokens, work.prefill_attention) == ("mixed", 17, 1 + 16 * (48 + 16))
    assert (StepWork.of([(0, 4)]).kind, StepWork.of([(4, 1)]).kind, StepWork().is_empty) == ("prefill", "decode", True)


# ---- the same step, described by each ---------------------------------------------------------------
def _scheduled_step() -> SchedulerOutput:
    """The step of EXPECTED, scheduled by the engine's scheduler (pure: no model)."""
    s = Scheduler(BlockManager(64, BLOCK), max_num_batched_tokens=64, max_model_len=1024)
    _run(s, Request("warm", PREFIX, params(1)))  # leaves PREFIX's blocks cached
    _run(s, Request("decoding", list(range(20, 25)), params(8)), steps=1)
    for request in _last_requests():
        s.add_request(request)
    return s.schedule()


def _run(s: Scheduler, request: Request, steps: int = 100) -> None:
    s.add_request(request)
    for _ in range(steps):
        if not s.has_unfinished_requests():
            return
        out = s.schedule()
        s.update_from_output(out, {c.request.request_id: SampledToken(7) for c in out.chunks if c.samples})


def _last_requests() -> list[Request]:
    return [
        Request("cached", PREFIX + [30], params(1)),
        Request("single", [40], params(1)),
        Request("long", list(range(50, 56)), params(1)),
    ]


def test_the_engine_describes_a_scheduled_step_with_the_model_runners_rule():
    out = _scheduled_step()
    assert out.work == EXPECTED
    # the model runner batches as decodes exactly the spans the description counts as decodes
    decodes = [c.request.request_id for c in out.chunks if is_decode(c)]
    assert sorted(decodes) == ["cached", "decoding"]


def test_the_simulator_times_the_step_the_engine_describes():
    seen = []
    model = SimpleNamespace(step_ms=lambda work: seen.append(work) or 1.0)
    assert SimInstance._step_ms(SimpleNamespace(step_model=model), _scheduled_step()) == 1.0
    assert seen == [EXPECTED]


def test_the_profiler_records_the_step_the_engine_describes():
    config = EngineConfig(
        model="random:tiny", dtype="float32", device="cpu", num_kv_blocks=64, block_size=BLOCK,
        max_num_batched_tokens=64, enable_prefix_caching=True,
    )  # fmt: skip
    engine = LLMEngine(config)
    for request_id, prompt, steps in (("warm", PREFIX, 100), ("decoding", list(range(20, 25)), 1)):
        engine.add_request(request_id, prompt_token_ids=prompt, sampling_params=params(1 if steps > 1 else 8))
        for _ in range(steps):
            if engine.has_unfinished_requests():
                engine.step()
    for request in _last_requests():
        engine.add_request(request.request_id, prompt_token_ids=request.prompt_token_ids, sampling_params=params(1))
    step = StepBench(engine).timed_step(budget=64)
    assert step.work == EXPECTED and step.ms > 0
    assert engine.step_stats[-1].work == EXPECTED  # what the worker reports to the router


# ---- the report format ----------------------------------------------------------------------------
def test_a_step_report_round_trips_through_the_registrys_json():
    step = MeasuredStep(EXPECTED, 12.34567, index=41)
    wire = json.loads(json.dumps(step.to_list()))  # as a LoadReport stores it in Redis
    assert wire == [41, 12.346, 2, 15, 0, 1, 0, 6]
    assert MeasuredStep.from_list(wire) == MeasuredStep(EXPECTED, 12.346, 41)
    decode_only = MeasuredStep(StepWork((), 3, 300), 2.0, 7)
    assert MeasuredStep.from_list(decode_only.to_list()) == decode_only


@pytest.mark.parametrize(
    "entry",
    [
        [41, 12.3, 2, 15, 0],  # a chunk's start without its tokens
        [41, 12.3, 2],  # too short
        [41, -1.0, 0, 0, 0, 4],  # a negative duration
        [41, 12.3, 2, 15, 0, 0],  # a chunk of no tokens
        [41, 100, 10_000, 4, 800, 12.346],  # the former layout: a duration where a count goes
        [41, "12", 0, 0],
        None,
    ],
)
def test_a_malformed_step_report_is_refused(entry):
    with pytest.raises((ValueError, TypeError)):
        MeasuredStep.from_list(entry)


def test_the_router_learns_well_formed_steps_and_skips_the_rest():
    from disagg.registry import LoadReport
    from disagg.router.directory import Instance

    learnt = []
    inst = SimpleNamespace(last_step_index=0, online=SimpleNamespace(observe=learnt.append))
    good = MeasuredStep(EXPECTED, 5.0, index=3)
    report = LoadReport(steps=[[1, "x"], good.to_list(), [2, 1.0, 1, 9, 0], None, good.to_list()])
    Instance.learn_steps(inst, report)
    assert learnt == [good]  # once: the second copy has an index already learnt
