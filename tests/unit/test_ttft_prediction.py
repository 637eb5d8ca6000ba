"""The TTFT prediction's terms against the engine's own scheduler (driven step by step and timed
by a known step model, as the simulator times it), the router's view of an instance's queue and
backlog, and the residual forgetting a past regime (pure: no server)."""

from __future__ import annotations

import itertools
import time

import pytest

from disagg.config import Role
from disagg.engine.block_manager import BlockManager
from disagg.engine.scheduler import SampledToken, Scheduler
from disagg.placement.latency_model import Coefficients, StepModel
from disagg.placement.predictor import Residual, ttft_ms
from disagg.placement.prefill_queue import Decodes, QueuedPrompt, forecast
from disagg.registry import InstanceInfo, InstanceView, LoadReport
from disagg.request import Request, SamplingParams
from disagg.router.directory import Instance
from disagg.router.prompt_queue import PromptQueue

# ms: prefill 5 + 0.1/token + 1e-4 * attention; decode 3 + 0.001/context token + 0.2/request
MODEL = StepModel(Coefficients(5.0, 0.1, 1e-4), Coefficients(3.0, 0.001, 0.2), Coefficients(3.0, 0.001, 0.2))
BUDGET = 256
_ids = itertools.count(1)


class Engine:
    """The engine's scheduler with a fake runner: every step timed by MODEL, every sampled token 0."""

    def __init__(self, role: Role, long_prefill_token_threshold: int | None = None, by_work: bool = True):
        self.scheduler = Scheduler(
            BlockManager(4096, 16),
            role=role,
            max_num_batched_tokens=BUDGET,
            long_prefill_token_threshold=long_prefill_token_threshold,
            # Fair prefill caps chunks by work: a token at context 500 costs two (MODEL's 0.1 / 2e-4).
            attention_context_tokens=MODEL.attention_context_tokens if by_work else None,
        )
        self.cap = self.scheduler.chunk_cap  # fair prefill's (None: a quarter of the budget; 0: none)
        self.ms = 0.0

    def add(self, prompt_len: int, prefix: list[int] = ()) -> Request:
        tokens = list(prefix) + [next(_ids) * 10_000 + i for i in range(prompt_len - len(prefix))]
        request = Request(f"r{next(_ids)}", tokens, SamplingParams(max_tokens=1000, ignore_eos=True))
        self.scheduler.add_request(request)
        return request

    def run_until_first_token(self, request: Request) -> float:
        """ms of the steps until `request` samples its first token."""
        self.ms = 0.0
        while not request.output_token_ids:
            out = self.scheduler.schedule()
            assert not out.is_empty
            self.ms += MODEL.step_ms(out.work)
            sampled = {c.request.request_id: SampledToken(0) for c in out.chunks if c.samples}
            self.scheduler.update_from_output(out, sampled)
        return self.ms


# ---- the queue ---------------------------------------------------------------------------------
THRESHOLDS = pytest.mark.parametrize("threshold", [None, 0, 100], ids=["fair", "fcfs", "cap100"])


def test_caps_by_tokens_only_are_forecast_as_the_scheduler_runs_them():
    engine, by_work = Engine(Role.PREFILL, by_work=False), Engine(Role.PREFILL)
    lengths = [QueuedPrompt(900), QueuedPrompt(60)]
    measured = []
    for e in (engine, by_work):
        e.add(900), e.add(60)
        measured.append(e.run_until_first_token(e.add(300)))
    assert forecast(MODEL, lengths, QueuedPrompt(300), BUDGET, chunk_cap=engine.cap, by_work=False).ms == pytest.approx(
        measured[0]
    )
    assert measured[0] != pytest.approx(measured[1]), "work caps change the steps here"


@THRESHOLDS
def test_the_queue_costs_the_steps_the_scheduler_runs_for_prompts_of_their_own_lengths(threshold):
    engine = Engine(Role.PREFILL, threshold)
    warm = engine.add(320)
    engine.run_until_first_token(warm)
    engine.scheduler.release(warm.request_id)  # its blocks stay cached
    # Queued: a long prompt, a short one, one whose first 320 tokens are cached; then the new one.
    queue = [engine.add(700), engine.add(40), engine.add(400, prefix=warm.prompt_token_ids)]
    new = engine.add(300)
    measured = engine.run_until_first_token(new)
    lengths = [QueuedPrompt(700), QueuedPrompt(40), QueuedPrompt(400, num_known=320)]
    assert queue[2].num_cached_tokens == 320
    assert forecast(MODEL, lengths, QueuedPrompt(300), BUDGET, chunk_cap=engine.cap).ms == pytest.approx(measured)
    # The old guess (queued tokens as long as the new prompt) misses the long prompt's attention
    # (first come first served) or how far the new prompt gets past it (fair prefill).
    guess = forecast(MODEL, [QueuedPrompt(300)] * 3, QueuedPrompt(300), BUDGET, chunk_cap=engine.cap).ms
    assert abs(guess - measured) > 0.05 * measured


def test_what_the_instance_has_spent_on_its_queue_is_not_waited_for_again():
    queue, new = [QueuedPrompt(700), QueuedPrompt(40)], QueuedPrompt(300)
    whole = forecast(MODEL, queue, new, BUDGET).ms
    assert forecast(MODEL, queue, new, BUDGET, progress_ms=50.0).ms == pytest.approx(whole - 50.0)
    # Longer than the queue was predicted to take: the prompt's own steps are left, after half of
    # the step under way (the queue's last, on average).
    late = forecast(MODEL, queue, new, BUDGET, progress_ms=10_000.0)
    own = sum(MODEL.step_ms(w) for w in late.steps[late.own_from :])
    assert late.ms == pytest.approx(own + MODEL.step_ms(late.steps[late.own_from - 1]) / 2)


@THRESHOLDS
def test_prompts_that_come_after_it_share_its_last_step_at_the_recent_rate(threshold):
    """Engine time: a 700-token prompt starts at 0, the new one comes at 30 ms, then a
    200-token prompt every 50 ms (the first 25 ms after it); each joins at a step boundary."""
    engine = Engine(Role.PREFILL, threshold)
    engine.add(700)
    arrivals = [(30.0, 200)] + [(30.0 + 50 * (k - 0.5), 200) for k in range(1, 20)]
    t, new = 0.0, None
    while new is None or not new.output_token_ids:
        while arrivals and arrivals[0][0] <= t:
            request = engine.add(arrivals.pop(0)[1])
            new = new or request
        out = engine.scheduler.schedule()
        t += MODEL.step_ms(out.work)
        sampled = {c.request.request_id: SampledToken(0) for c in out.chunks if c.samples}
        engine.scheduler.update_from_output(out, sampled)
    predicted = forecast(
        MODEL,
        [QueuedPrompt(700)],
        QueuedPrompt(200),
        BUDGET,
        progress_ms=30.0,
        arrivals_per_ms=4.0,
        chunk_cap=engine.cap,
    )
    assert predicted.ms == pytest.approx(t - 30.0)
    last = predicted.steps[-1].prefill_tokens
    if engine.cap >= BUDGET:
        assert last == BUDGET  # filled by those that came meanwhile
    else:  # the step that finishes it gives the others only their caps
        assert BUDGET // 2 < last < BUDGET
    alone = forecast(MODEL, [QueuedPrompt(700)], QueuedPrompt(200), BUDGET, progress_ms=30.0, chunk_cap=engine.cap)
    if threshold == 0:  # first come first served: they fill its last step, which takes longer
        assert alone.ms < predicted.ms


# ---- mixed steps -------------------------------------------------------------------------------
def _decoding_engine(batch: int, threshold: int | None = None) -> tuple[Engine, Decodes]:
    """A colocated engine with `batch` requests decoding, and them as the predictor sees them."""
    engine = Engine(Role.COLOCATED, threshold)
    running = [engine.add(100 + 30 * i) for i in range(batch)]
    for request in running:
        engine.run_until_first_token(request)
    return engine, Decodes(batch, sum(r.num_tokens for r in running))


@THRESHOLDS
def test_on_an_instance_that_decodes_each_step_is_the_mixed_step_with_the_batch_riding_along(threshold):
    engine, decodes = _decoding_engine(batch=12, threshold=threshold)
    engine.add(500)  # queued ahead: it joins the decodes once through
    new = engine.add(300)
    measured = engine.run_until_first_token(new)
    predicted = forecast(MODEL, [QueuedPrompt(500)], QueuedPrompt(300), BUDGET, decodes, chunk_cap=engine.cap)
    assert predicted.ms == pytest.approx(measured)
    assert all(work.kind == "mixed" for work in predicted.steps)
    no_batch = forecast(MODEL, [QueuedPrompt(500)], QueuedPrompt(300), BUDGET, chunk_cap=engine.cap)
    assert no_batch.ms < measured  # too fast


def test_with_nothing_queued_a_prompt_waits_for_half_of_the_decode_step_under_way():
    engine, decodes = _decoding_engine(batch=12)
    new = engine.add(300)
    measured = engine.run_until_first_token(new)
    under_way = MODEL.decode_ms(decodes.batch, decodes.context_sum)
    assert forecast(MODEL, [], QueuedPrompt(300), BUDGET, decodes).ms == pytest.approx(measured + under_way / 2)


# ---- the backlog -------------------------------------------------------------------------------
class Side:
    """A prefill instance as the predictor reads it."""

    instance_id, step_model, prefill_budget, prefill_chunk_cap, prefill_by_work = "p0", MODEL, BUDGET, None, True
    prefill_calibrated, riding_decodes, arriving_tokens_per_ms = True, None, 0.0

    def __init__(self, queued=(), backlog=0, progress_ms=0.0):
        self.queued_prompts, self.backlog_tokens, self.queue_progress_ms = list(queued), backlog, progress_ms

    def cached_tokens(self, block_hashes) -> int:
        return 0

    def ttft_residual_ms(self, model_ms: float) -> float:
        return 0.0


def test_a_reported_backlog_is_computed_first_as_prompts_like_the_new_one():
    known = Side(queued=[QueuedPrompt(500)])
    with_backlog = Side(queued=[QueuedPrompt(500)], backlog=600)
    expected = forecast(MODEL, [QueuedPrompt(200)] * 3 + [QueuedPrompt(500)], QueuedPrompt(200), BUDGET).ms
    assert ttft_ms(with_backlog, 200) == pytest.approx(expected)
    assert ttft_ms(with_backlog, 200) > ttft_ms(known, 200) + 60  # 600 more tokens, 3 more steps


def _instance(role: str = "prefill", **load) -> Instance:
    info = InstanceInfo("p0", role, "actor", "kv", "model")
    return Instance("p0", role, None, InstanceView(info, LoadReport(**load), 0.0), None)


def test_the_backlog_is_what_the_report_counted_beyond_this_routers_prompts_then():
    inst = _instance()
    sent = inst.prompt_queue.add(300, 0)
    sent.sent_at -= 1.0
    stamp = time.time() - 0.5
    inst.view.load = LoadReport(queued_prefill_tokens=300 + 700, updated_at=stamp)  # 700 from elsewhere
    assert inst.backlog_tokens == 700 and inst.predicted_queue_tokens == 1000
    inst.prompt_queue.remove(sent)  # through after the report: the report still counted it
    assert inst.backlog_tokens == 700
    assert inst.queue_progress_ms >= 0.0  # working on the backlog since the report at least
    inst.view.load = LoadReport(queued_prefill_tokens=250, updated_at=time.time() - 10)  # before it was sent
    assert inst.backlog_tokens == 250


def test_a_prefill_instance_carries_no_decodes_and_a_colocated_one_its_batch_less_its_queue():
    assert _instance().riding_decodes is None
    colocated = _instance("colocated", num_running=5, decode_context_tokens=5 * 200)
    colocated.prompt_queue.add(150, 0)  # placed, and running there, but not through its prefill
    assert colocated.riding_decodes == Decodes(4, 1000 - 150)


def test_the_queue_has_worked_since_its_first_prompt_came_or_the_one_before_was_through():
    queue = PromptQueue()
    assert queue.progress_ms() == 0.0
    first = queue.add(100, 0)
    first.sent_at -= 0.5
    queue.add(200, 0)
    assert queue.progress_ms() == pytest.approx(500, abs=50)
    queue.remove(first)
    assert queue.progress_ms() == pytest.approx(0, abs=50) and [p.num_tokens for p in queue.prompts] == [200]


# ---- the residual ----------------------------------------------------------------------------------
def test_the_residual_forgets_a_saturation_episode_within_a_few_requests():
    residual, now = Residual(), 0.0
    for _ in range(32):  # saturated: measured 300 ms above the model
        now += 0.2
        residual.observe(measured_ms=400.0, predicted_ms=100.0, now=now)
    assert residual.value == pytest.approx(300.0)
    followed_after = None
    for n in range(1, 10):  # then moderate load: 20 ms above
        now += 0.4
        residual.observe(measured_ms=120.0, predicted_ms=100.0, now=now)
        if followed_after is None and residual.value == pytest.approx(20.0):
            followed_after = n
    assert followed_after is not None and followed_after <= 5


def test_after_a_pause_the_first_request_sets_the_residual():
    residual = Residual()
    for i in range(32):
        residual.observe(measured_ms=400.0, predicted_ms=100.0, now=float(i))
    residual.observe(measured_ms=110.0, predicted_ms=100.0, now=31.0 + 120.0)  # two minutes later
    assert residual.value == pytest.approx(10.0)


def test_one_outlier_among_recent_errors_moves_nothing():
    residual = Residual()
    for i in range(10):
        residual.observe(measured_ms=130.0, predicted_ms=100.0, now=i * 0.1)
    residual.observe(measured_ms=900.0, predicted_ms=100.0, now=1.0)
    assert residual.value == pytest.approx(30.0)


def test_errors_of_predictions_many_times_longer_hardly_count():
    residual, now = Residual(), 0.0
    for _ in range(32):  # saturated: 5 s predicted, 3 s more measured
        now += 0.2
        residual.observe(measured_ms=8000.0, predicted_ms=5000.0, now=now)
    residual.observe(measured_ms=220.0, predicted_ms=200.0, now=now + 0.4)  # the first at moderate load
    assert residual.value_for(200.0) == pytest.approx(20.0)
    assert residual.value_for(5000.0) == pytest.approx(3000.0)  # the regime it learnt, should it return


def test_where_no_recent_error_is_alike_the_seed_holds():
    residual, now = Residual(), 0.0
    for _ in range(32):
        now += 0.2
        residual.observe(measured_ms=8000.0, predicted_ms=5000.0, now=now)
    assert residual.value_for(200.0) == 0.0  # not the saturation's 3 s
