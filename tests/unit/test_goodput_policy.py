"""The goodput-aware policy's choices on constructed cluster states, and the online fit of a
step model converging on synthetic step times (pure: no server)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from disagg.placement.goodput import GoodputPolicy
from disagg.placement.policies import RequestShape
from disagg.slo import SLO
from disagg.placement.latency_model import Coefficients, StepModel
from disagg.placement.online_fit import OnlineStepModel
from disagg.placement.predictor import Residual, tpot_ms, ttft_ms
from disagg.placement.prefill_queue import Decodes, QueuedPrompt, forecast
from disagg.step_work import Chunk, MeasuredStep, StepWork

# ms: prefill 5 + 0.1/token + 1e-4 * attention; decode 3 + 0.001/context token + 0.2/request
TRUE = StepModel(Coefficients(5.0, 0.1, 1e-4), Coefficients(3.0, 0.001, 0.2), Coefficients(3.0, 0.001, 0.2))


@dataclass
class Inst:
    """An instance's state as the predictor reads it; its id says its role ("p...": a prefill
    instance, whose steps carry no decodes). `queued_prefill_tokens`: a backlog of prompts not
    known one by one; `queued`: prompts known (what the router sent)."""

    instance_id: str
    step_model: StepModel = TRUE
    queued_prefill_tokens: int = 0
    decode_batch: int = 0
    decode_context_tokens: int = 0
    free_blocks: int = 1000
    prefill_budget: int = 512
    prefill_chunk_cap: int | None = None
    prefill_by_work: bool = True
    ttft_residual: float = 0.0
    tpot_residual: float = 0.0
    prefill_calibrated: bool = True
    decode_calibrated: bool = True
    warm: tuple = ()  # block hashes it holds
    queued: tuple = ()
    queue_progress_ms: float = 0.0
    arriving_tokens_per_ms: float = 0.0

    def ttft_residual_ms(self, model_ms: float) -> float:
        return self.ttft_residual

    def tpot_residual_ms(self, model_ms: float) -> float:
        return self.tpot_residual

    @property
    def queued_prompts(self) -> list[QueuedPrompt]:
        return list(self.queued)

    @property
    def backlog_tokens(self) -> int:
        return self.queued_prefill_tokens

    @property
    def riding_decodes(self) -> Decodes | None:
        return None if self.instance_id.startswith("p") else Decodes(self.decode_batch, self.decode_context_tokens)

    @property
    def predicted_queue_tokens(self) -> int:
        return self.queued_prefill_tokens + sum(p.num_new for p in self.queued)

    def cached_tokens(self, block_hashes) -> int:
        hits = 0
        for h in block_hashes:
            if h not in self.warm:
                break
            hits += 1
        return 16 * hits


def shape(prompt=100, max_tokens=50, ttft=1000.0, tpot=50.0, priority="standard") -> RequestShape:
    return RequestShape(prompt, max_tokens, SLO(ttft, tpot), priority)


# ---- predictions ---------------------------------------------------------------------------------
def test_a_chunked_prompt_costs_its_steps_and_its_whole_attention():
    # 1000 tokens in steps of 512: two intercepts, 1000 tokens, attention 1000^2 (chunks add up to l^2)
    alone = forecast(TRUE, [], QueuedPrompt(1000), 512).ms
    assert alone == pytest.approx(2 * 5 + 0.1 * 1000 + 1e-4 * 1000**2)
    # a prompt queued ahead comes first: more steps and more tokens
    assert forecast(TRUE, [QueuedPrompt(1000)], QueuedPrompt(1000), 512).ms > alone + 100


def test_tpot_counts_the_batch_with_the_request_added():
    idle, busy = Inst("idle"), Inst("busy", decode_batch=40, decode_context_tokens=40 * 500)
    assert tpot_ms(idle, 100, 50) == pytest.approx(3 + 0.001 * (100 + 25) + 0.2)
    assert tpot_ms(busy, 100, 50) == pytest.approx(3 + 0.001 * (20000 + 100 + 41 * 25) + 0.2 * 41)


def test_the_residual_learns_what_the_model_misses_and_forgets_a_cold_start():
    residual = Residual(window=8)
    residual.observe(measured_ms=400.0, predicted_ms=100.0)  # a first request, building kernels
    assert residual.value == pytest.approx(300.0)
    for _ in range(5):
        residual.observe(measured_ms=130.0, predicted_ms=100.0)
    assert residual.value == pytest.approx(30.0)  # the median: one outlier moves nothing


# ---- placement ---------------------------------------------------------------------------------
def test_the_prefill_with_the_shorter_queue_wins():
    policy = GoodputPolicy()
    fast, queued = Inst("p-idle"), Inst("p-queued", queued_prefill_tokens=4000)
    choice = policy.choose_pair([queued, fast], [Inst("d0")], shape())
    assert choice.prefill is fast and choice.admitted
    assert choice.ttft_ms == pytest.approx(ttft_ms(fast, 100))


def test_a_slower_instance_is_chosen_only_when_the_faster_one_is_predicted_later():
    slow_model = StepModel(Coefficients(10.0, 0.2, 2e-4), TRUE.decode_small, TRUE.decode_large)
    fast, slow = Inst("p-fast", queued_prefill_tokens=1000), Inst("p-slow", step_model=slow_model)
    decode = [Inst("d0")]
    assert GoodputPolicy().choose_pair([fast, slow], decode, shape(ttft=200)).prefill is slow
    fast.queued_prefill_tokens = 100
    assert GoodputPolicy().choose_pair([fast, slow], decode, shape(ttft=200)).prefill is fast


def test_the_decode_whose_batch_keeps_the_tpot_wins_over_the_less_loaded_prefill_pairing():
    crowded = Inst("d-crowded", decode_batch=200, decode_context_tokens=200 * 1000)  # ~243 ms a token
    light = Inst("d-light", decode_batch=100, decode_context_tokens=100 * 100)
    choice = GoodputPolicy().choose_pair([Inst("p0")], [crowded, light], shape(tpot=100))
    assert choice.decode is light and choice.tpot_ms < 100


def test_a_decode_without_room_for_the_prompt_is_passed_over():
    full, roomy = Inst("d-full", free_blocks=2), Inst("d-roomy", decode_batch=50, free_blocks=100)
    request = RequestShape(100, 50, SLO(), blocks_needed=7)
    assert GoodputPolicy().choose_pair([Inst("p0")], [full, roomy], request).decode is roomy


def test_without_slos_the_least_loaded_pair_wins():
    prefills = [Inst("p0", queued_prefill_tokens=300), Inst("p1", queued_prefill_tokens=100)]
    decodes = [Inst("d0", decode_batch=5), Inst("d1", decode_batch=2)]
    choice = GoodputPolicy().choose_pair(prefills, decodes, RequestShape(100, 50, SLO()))
    assert (choice.prefill.instance_id, choice.decode.instance_id) == ("p1", "d1")


def test_predictions_within_the_models_error_go_by_load():
    # d0 carries 3 more requests and is still predicted 8% faster (3.6 ms to 3.9 ms, TTFT and
    # TPOT): equal within the model's error, so the lighter one takes the request
    cheap_prefill = Coefficients(0.5, 0.001, 0.0)
    d0_model = StepModel(cheap_prefill, Coefficients(2.0, 0.001, 0.2), Coefficients(2.0, 0.001, 0.2))
    d1_model = StepModel(cheap_prefill, TRUE.decode_small, TRUE.decode_large)
    prefill = [Inst("p0", step_model=d1_model)]
    decodes = [Inst("d0", step_model=d0_model, decode_batch=3), Inst("d1", step_model=d1_model)]
    request = RequestShape(100, 50, SLO())
    assert GoodputPolicy().choose_pair(prefill, decodes, request).decode.instance_id == "d1"
    # faster beyond the error (2.6 ms): it wins, loaded as it is
    decodes[0].step_model = StepModel(cheap_prefill, Coefficients(1.0, 0.001, 0.2), Coefficients(1.0, 0.001, 0.2))
    assert GoodputPolicy().choose_pair(prefill, decodes, request).decode.instance_id == "d0"


def test_while_an_instance_is_predicted_on_a_guess_placement_goes_by_load():
    guessed_fast = StepModel(TRUE.prefill, Coefficients(0.5, 0.0, 0.0), Coefficients(0.5, 0.0, 0.0))
    decodes = [Inst("d0", step_model=guessed_fast, decode_batch=3, decode_calibrated=False), Inst("d1")]
    assert GoodputPolicy().choose_pair([Inst("p0")], decodes, RequestShape(100, 50, SLO())).decode.instance_id == "d1"


def test_a_new_residual_holds_its_seed_until_its_first_observation():
    residual = Residual(seed_ms=10.0)
    assert residual.value == 10.0
    residual.observe(measured_ms=102.0, predicted_ms=100.0)
    assert residual.value == pytest.approx(2.0)


def test_nothing_is_refused_while_the_cluster_is_idle_so_a_pessimistic_model_can_learn():
    slow = StepModel(Coefficients(5000.0, 0.1, 1e-4), TRUE.decode_small, TRUE.decode_large)  # predicts 5 s
    idle = Inst("p0", step_model=slow)
    assert GoodputPolicy().choose_pair([idle], [Inst("d0")], shape(ttft=500)).admitted
    busy_elsewhere = Inst("d1", decode_batch=1)
    assert not GoodputPolicy().choose_pair([idle], [Inst("d0"), busy_elsewhere], shape(ttft=500)).admitted
    idle.queued_prefill_tokens = 10
    assert not GoodputPolicy().choose_pair([idle], [Inst("d0")], shape(ttft=500)).admitted


def test_what_no_pair_can_serve_in_time_is_refused_with_its_prediction():
    swamped = Inst("p0", queued_prefill_tokens=50_000)
    choice = GoodputPolicy().choose_pair([swamped], [Inst("d0")], shape(ttft=500))
    assert not choice.admitted and choice.headroom < 0
    assert f"best predicted TTFT {choice.ttft_ms:.0f} ms" in choice.refusal(SLO(500, 50))
    assert GoodputPolicy(best_effort=True).choose_pair([swamped], [Inst("d0")], shape(ttft=500)).admitted
    swamped.prefill_calibrated = False  # its model is still a guess: nothing is refused on it
    assert GoodputPolicy().choose_pair([swamped], [Inst("d0")], shape(ttft=500)).admitted


@pytest.mark.parametrize(
    "queued, admitted",
    [
        (0, {"critical", "standard", "sheddable"}),  # plenty of room
        (7_500, {"critical", "standard"}),  # ~910 ms: within the SLO, less than the sheddable margin left
        (20_000, {"critical"}),  # predicted to miss: only critical goes on
    ],
)
def test_priorities_shed_sheddable_first_and_critical_last(queued, admitted):
    prefill = [Inst("p0", queued_prefill_tokens=queued)]
    got = {
        priority
        for priority in ("critical", "standard", "sheddable")
        if GoodputPolicy().choose_pair(prefill, [Inst("d0")], shape(ttft=1000, priority=priority)).admitted
    }
    assert got == admitted


def test_a_colocated_pool_pairs_each_instance_with_itself():
    pool = [Inst("c0", queued_prefill_tokens=5000), Inst("c1")]
    choice = GoodputPolicy().choose_pair(pool, pool, shape())
    assert choice.prefill is choice.decode is pool[1]


def test_an_empty_pool_gives_no_choice():
    assert GoodputPolicy().choose_pair([], [Inst("d0")], shape()) is None
    assert GoodputPolicy().choose_pair([Inst("p0")], [], shape()) is None


def test_an_unknown_priority_is_a_value_error():
    with pytest.raises(ValueError, match="priority"):
        shape(priority="urgent")


# ---- the online fit ------------------------------------------------------------------------------
def _synthetic_steps(n: int, seed: int = 0) -> list[MeasuredStep]:
    rng, samples = random.Random(seed), []
    for _ in range(n):
        if rng.random() < 0.5:
            work = StepWork((Chunk(rng.choice([0, 0, 512, 1024]), rng.randint(16, 512)),))
        else:
            batch = rng.randint(1, 64)
            work = StepWork((), batch, batch * rng.randint(50, 2000))
        samples.append(MeasuredStep(work, TRUE.step_ms(work) * rng.uniform(0.98, 1.02)))
    return samples


def test_the_online_fit_converges_from_a_wrong_seed():
    wrong = TRUE.scaled(3.0)
    online = OnlineStepModel(wrong, refit_every=8)
    steps = _synthetic_steps(200)
    for sample in steps[:16]:
        online.observe(sample)
    assert online.recent_error() > 0.5  # the seed is 3x off
    for sample in steps[16:]:
        online.observe(sample)
    assert online.recent_error() < 0.05
    for sample in _synthetic_steps(50, seed=1):  # held out
        assert online.model.step_ms(sample.work) == pytest.approx(sample.ms, rel=0.06)


def test_too_few_samples_keep_the_seed():
    online = OnlineStepModel(TRUE.scaled(2.0), refit_every=1)
    for sample in _synthetic_steps(5):
        online.observe(sample)
    assert online.model == TRUE.scaled(2.0)


def test_a_model_that_forgets_its_first_steps_learns_from_the_later_ones_alone():
    online = OnlineStepModel(TRUE.scaled(2.0), refit_every=8)
    for sample in _synthetic_steps(40):  # first steps, 5x slow (kernels built on first use)
        online.observe(sample.with_ms(sample.ms * 5))
    online.forget()
    assert online.model == TRUE.scaled(2.0) and online.num_samples == 0 and not online.calibrated("prefill")
    for sample in _synthetic_steps(40, seed=1):
        online.observe(sample)
    for sample in _synthetic_steps(20, seed=2):  # held out
        assert online.model.step_ms(sample.work) == pytest.approx(sample.ms, rel=0.06)


def test_a_request_goes_where_its_prefix_is_warm_unless_that_instance_is_predicted_to_miss():
    prompt_hashes = tuple(range(1, 33))  # 32 blocks: 512 of its 520 tokens cacheable
    warm = Inst("p-warm", warm=prompt_hashes, queued_prefill_tokens=400)
    cold = Inst("p-cold")
    request = RequestShape(520, 50, SLO(1000, 50), block_hashes=prompt_hashes)
    choice = GoodputPolicy().choose_pair([cold, warm], [Inst("d0")], request)
    assert choice.prefill is warm and choice.cached_tokens == 512
    assert choice.ttft_ms < ttft_ms(cold, 520)
    warm.queued_prefill_tokens = 20_000  # warm, but far behind
    assert GoodputPolicy().choose_pair([cold, warm], [Inst("d0")], request).prefill is cold


def test_cached_tokens_are_not_computed_again():
    full = forecast(TRUE, [], QueuedPrompt(1000), 512).ms
    cached = forecast(TRUE, [], QueuedPrompt(1000, num_known=960), 512).ms
    assert cached == pytest.approx(5 + 0.1 * 40 + 1e-4 * (1000**2 - 960**2))
    assert cached < full / 5


def test_a_fit_never_says_more_requests_make_faster_steps():
    """Decode steps whose times fall slightly with the batch (noise, or a narrow window) must not
    fit a negative per-request cost: the policy would crowd requests onto the busiest instance."""
    online = OnlineStepModel(TRUE, refit_every=1)
    for batch in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10):
        online.observe(MeasuredStep(StepWork((), batch, batch * 100), 20.0 - 0.1 * batch))
    decode = online.model.decode_small
    assert decode.b >= 0 and decode.c >= 0
    assert online.model.decode_ms(10, 1000) >= online.model.decode_ms(1, 100)


# ---- conditional disaggregation ------------------------------------------------------------------
def _conditional(decode: Inst, prompt: int = 64, limit: int = 256, tpot: float = 0.0):
    prefill = Inst("p0", ttft_residual=30.0)  # what a disaggregated TTFT pays beyond compute: hops, KV
    request = RequestShape(prompt, 20, SLO(0.0, tpot))
    return GoodputPolicy(local_prefill_max_tokens=limit).choose_pair([prefill], [decode], request)


def test_a_short_prompt_is_prefilled_on_an_idle_decode_instance_when_that_is_predicted_faster():
    decode = Inst("d0", prefill_calibrated=False)  # never prefilled: predicted with the prefill pool's form
    choice = _conditional(decode)
    assert choice.local and choice.prefill is decode and choice.decode is decode
    assert choice.ttft_ms == pytest.approx(5 + 0.1 * 64 + 1e-4 * 64 * 64)  # no hop, no transfer


def test_conditional_disaggregation_is_off_at_limit_zero_and_for_longer_prompts():
    assert not _conditional(Inst("d0"), limit=0).local
    assert not _conditional(Inst("d0"), prompt=300, limit=256).local
    assert not _conditional(Inst("d0", prefill_budget=32), prompt=64).local  # more than one chunk


def test_a_chunk_that_would_stall_a_busy_batch_beyond_its_tpot_goes_to_the_prefill_pool():
    busy = Inst("d0", decode_batch=8, decode_context_tokens=8 * 1000)  # a step: 3 + 8 + 1.6 = 12.6 ms
    # a 200-token chunk makes the step a mixed one of 29 + 9.6 ms: 26 ms more than the decode step
    # alone, spread over 10 remaining tokens: 2.6 ms more a token
    assert not _conditional(busy, prompt=200).local  # no target: more than the model's error (1.26 ms)
    assert _conditional(busy, prompt=200, tpot=50.0).local  # 15.2 ms: within the target
    assert not _conditional(busy, prompt=200, tpot=15.0).local
    assert _conditional(busy, prompt=4).local  # 2.4 ms over 10 tokens: within the model's error


def test_no_local_prefill_on_a_guess():
    assert not _conditional(Inst("d0", decode_calibrated=False)).local


def _next_turn(prefill_warm: tuple, decode_warm: tuple, reuse: int = 256):
    """A conversation's next turn: 8 blocks of history and 64 new tokens."""
    prefill, decode = Inst("p0", ttft_residual=30.0, warm=prefill_warm), Inst("d0", warm=decode_warm)
    request = RequestShape(8 * 16 + 64, 20, SLO(), block_hashes=tuple(range(8)))
    return GoodputPolicy(decode_reuse_max_tokens=reuse).choose_pair([prefill], [decode], request)


def test_a_decode_instance_holding_more_of_the_history_prefills_the_new_tokens_itself():
    choice = _next_turn(prefill_warm=tuple(range(7)), decode_warm=tuple(range(8)))  # its last answer: only there
    assert choice.local and choice.prefill is choice.decode and choice.cached_tokens == 128


def test_decode_side_reuse_needs_the_longer_prefix_and_a_short_increment():
    assert not _next_turn(prefill_warm=tuple(range(8)), decode_warm=tuple(range(8))).local  # no more there
    assert not _next_turn(prefill_warm=(), decode_warm=tuple(range(8)), reuse=32).local  # 64 new: too many
    assert not _next_turn(prefill_warm=(), decode_warm=tuple(range(8)), reuse=0).local  # off


def test_on_a_guessed_model_a_warm_prefix_still_counts_as_less_work():
    cold, warm = Inst("p0", prefill_calibrated=False), Inst("p1", prefill_calibrated=False, warm=(1, 2, 3))
    request = RequestShape(64, 8, SLO(), block_hashes=(1, 2, 3))
    choice = GoodputPolicy().choose_pair([cold, warm], [Inst("d0")], request)
    assert choice.prefill is warm and choice.cached_tokens == 48


def test_an_instance_predicted_as_no_number_is_placed_last_and_nothing_fails():
    """A NaN prediction compared false with everything: the tie set came out empty and the
    request failed. It is now the worst option, taken only where nothing else is."""
    broken = StepModel(Coefficients(float("nan"), 0.1, 1e-4), TRUE.decode_small, TRUE.decode_large)
    sick, healthy = Inst("p-sick", step_model=broken), Inst("p-ok")
    assert GoodputPolicy().choose_pair([sick, healthy], [Inst("d0")], shape()).prefill is healthy
    alone = GoodputPolicy(best_effort=True).choose_pair([sick], [Inst("d0")], shape())
    assert alone.prefill is sick and alone.headroom == float("-inf")
