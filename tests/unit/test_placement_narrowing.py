"""Placement at scale (issue 40): the goodput policy scores only the pairs that can be chosen,
and in a large pool predicts only some instances (disagg.placement.narrowing). Pure: instance
states are constructed."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from disagg.config import ServingConfig
from disagg.errors import InvalidRequestError
from disagg.placement import goodput
from disagg.placement.factory import placement_policy
from disagg.placement.goodput import GoodputPolicy, _pick, _Sides
from disagg.placement.latency_model import Coefficients, StepModel
from disagg.placement.narrowing import Narrowing, prefill_load
from disagg.placement.policies import RequestShape
from disagg.slo import SLO
from disagg.placement.prefill_queue import Decodes

# ms: prefill 5 + 0.1/token + 1e-4 * attention; decode 3 + 0.001/context token + 0.2/request
MODEL = StepModel(Coefficients(5.0, 0.1, 1e-4), Coefficients(3.0, 0.001, 0.2), Coefficients(3.0, 0.001, 0.2))
SLOW = StepModel(Coefficients(8.0, 0.15, 2e-4), Coefficients(4.0, 0.0015, 0.3), Coefficients(4.0, 0.0015, 0.3))
FULL = Narrowing(candidates=0)
CANDIDATES = Narrowing().candidates


@dataclass(eq=False)
class Inst:
    """An instance's state as the predictor reads it, counting the predictions made of it (each
    reads its residual once)."""

    instance_id: str
    step_model: StepModel = MODEL
    queued_prefill_tokens: int = 0
    decode_batch: int = 0
    decode_context_tokens: int = 0
    free_blocks: int = 1000
    prefill_budget: int = 512
    prefill_chunk_cap: int | None = None
    prefill_by_work: bool = True
    prefill_calibrated: bool = True
    decode_calibrated: bool = True
    warm: frozenset = frozenset()  # block hashes it holds
    residual_ms: float = 0.0
    queue_progress_ms: float = 0.0
    arriving_tokens_per_ms: float = 0.0
    predictions: int = 0

    def ttft_residual_ms(self, model_ms: float) -> float:
        self.predictions += 1
        return self.residual_ms

    def tpot_residual_ms(self, model_ms: float) -> float:
        self.predictions += 1
        return self.residual_ms

    queued_prompts: tuple = ()

    @property
    def backlog_tokens(self) -> int:
        return self.queued_prefill_tokens

    @property
    def riding_decodes(self) -> Decodes | None:
        return None if self.instance_id.startswith("p") else Decodes(self.decode_batch, self.decode_context_tokens)

    @property
    def predicted_queue_tokens(self) -> int:
        return self.queued_prefill_tokens

    def cached_tokens(self, block_hashes) -> int:
        hits = 0
        for h in block_hashes:
            if h not in self.warm:
                break
            hits += 1
        return 16 * hits


def random_pools(rng: random.Random, num_prefill: int, num_decode: int, mixed: bool = True) -> tuple[list, list]:
    """Instances of random load; `mixed`: also of two speeds, some on a guessed model, some
    holding a prefix of the prompts `random_request` draws, some with residuals."""
    prefills = [
        Inst(f"p{i}", queued_prefill_tokens=rng.choice([0, 0, rng.randrange(0, 4000)])) for i in range(num_prefill)
    ]
    decodes = [Inst(f"d{j}", decode_batch=rng.randrange(0, 40)) for j in range(num_decode)]
    for d in decodes:
        d.decode_context_tokens = d.decode_batch * rng.randrange(100, 900)
        d.free_blocks = rng.choice([1000, 1000, 3])
    if mixed:
        for inst in prefills + decodes:
            inst.step_model = rng.choice([MODEL, SLOW])
            inst.prefill_calibrated = inst.decode_calibrated = rng.random() > 0.1
            inst.residual_ms = rng.choice([0.0, 0.0, rng.uniform(-2, 30)])
            inst.warm = frozenset(range(rng.choice([0, 0, 0, 2, 8])))
            if inst.instance_id.startswith("d") and rng.random() < 0.3:  # a decode instance has prefilled
                inst.warm = frozenset(range(8))
    return prefills, decodes


def random_request(rng: random.Random) -> RequestShape:
    slo = rng.choice([SLO(), SLO(600.0, 0.0), SLO(0.0, 12.0), SLO(400.0, 15.0), SLO(80.0, 6.0)])
    prompt = rng.randrange(16, 1500)
    hashes = tuple(range(rng.choice([0, 4, 8]))) if prompt >= 128 else ()
    return RequestShape(prompt, rng.randrange(4, 200), slo, rng.choice(["standard", "sheddable"]), 4, hashes)


def every_pair(policy: GoodputPolicy, prefills: list, decodes: list, request: RequestShape):
    """What the policy chose before issue 40: every instance predicted, every pair scored."""
    roomy = [d for d in decodes if d.free_blocks >= request.blocks_needed] or decodes
    sides = _Sides.predict(prefills, roomy, request)
    pairs = [sides.option(i, j, request) for i in range(len(prefills)) for j in range(len(roomy))]
    local = policy._local_options(prefills, roomy, request, sides.tpots, max(sides.cached, default=0))
    return _pick(pairs + local, request)


def same_choice(choice, option) -> bool:
    return (choice.prefill, choice.decode, choice.local) == (option.prefill, option.decode, option.local)


# ---- exact: the pairs scored choose as all pairs do ------------------------------------------------
def chooses_as_every_pair(prefills, decodes, request, local_prefill_max_tokens: int) -> None:
    policy = GoodputPolicy(local_prefill_max_tokens=local_prefill_max_tokens, narrowing=FULL)
    choice = policy.choose_pair(prefills, decodes, request)
    reference = every_pair(policy, prefills, decodes, request)
    assert same_choice(choice, reference), (request, choice, reference)
    assert choice.headroom == reference.headroom and choice.ttft_ms == reference.ttft_ms


@pytest.mark.parametrize("local_prefill_max_tokens", [0, 256])
def test_scoring_only_the_pairs_that_can_win_chooses_as_scoring_every_pair(local_prefill_max_tokens):
    rng = random.Random(40)
    for _ in range(300):
        prefills, decodes = random_pools(rng, rng.randrange(1, 7), rng.randrange(1, 7))
        chooses_as_every_pair(prefills, decodes, random_request(rng), local_prefill_max_tokens)


@pytest.mark.parametrize("local_prefill_max_tokens", [0, 256])
def test_in_pools_of_many_alike_instances_the_full_search_chooses_as_scoring_every_pair(local_prefill_max_tokens):
    """Many pairs tied in headroom, latency and load (idle instances alike, as in a simulated
    pool): of those, the rendezvous hash's pair, found without scoring each."""
    rng = random.Random(41)
    for _ in range(150):
        prefills, decodes = random_pools(rng, rng.randrange(1, 30), rng.randrange(1, 30), mixed=rng.random() < 0.3)
        for inst in prefills + decodes:
            if rng.random() < 0.7:  # idle, and alike
                inst.queued_prefill_tokens = inst.decode_batch = inst.decode_context_tokens = 0
                inst.step_model, inst.residual_ms, inst.free_blocks = MODEL, 0.0, 1000
        chooses_as_every_pair(prefills, decodes, random_request(rng), local_prefill_max_tokens)


def test_the_full_search_of_an_idle_pool_scores_few_pairs(monkeypatch):
    built = []
    monkeypatch.setattr(goodput, "_Option", lambda *a, **k: built.append(1) or _real_option(*a, **k))
    prefills, decodes = random_pools(random.Random(6), 200, 200, mixed=False)
    for inst in prefills + decodes:
        inst.queued_prefill_tokens = inst.decode_batch = inst.decode_context_tokens = 0
    request = RequestShape(300, 50, SLO(1000.0, 50.0), blocks_needed=4, block_hashes=(7,))
    choice = GoodputPolicy(narrowing=FULL).choose_pair(prefills, decodes, request)
    assert len(built) <= 4
    reference = every_pair(GoodputPolicy(narrowing=FULL), prefills, decodes, request)
    assert same_choice(choice, reference)


def test_up_to_the_candidates_nothing_is_narrowed_and_the_choice_is_the_full_searchs():
    rng = random.Random(8)
    for _ in range(100):
        prefills, decodes = random_pools(rng, 8, 8)
        request = random_request(rng)
        narrowed = GoodputPolicy().choose_pair(prefills, decodes, request)
        full = GoodputPolicy(narrowing=FULL).choose_pair(prefills, decodes, request)
        assert (narrowed.prefill, narrowed.decode, narrowed.admitted) == (full.prefill, full.decode, full.admitted)


# ---- narrowed --------------------------------------------------------------------------------------
def test_where_instances_differ_in_load_alone_narrowing_chooses_the_full_searchs_pair():
    """The least loaded of each pool is the fastest, and always a candidate."""
    rng = random.Random(64)
    for _ in range(40):
        prefills, decodes = random_pools(rng, 64, 64, mixed=False)
        for p, queued in zip(prefills, rng.sample(range(0, 4000, 16), 64)):  # no two alike: no ties
            p.queued_prefill_tokens = queued
        for d, batch in zip(decodes, rng.sample(range(64), 64)):
            d.decode_batch, d.decode_context_tokens = batch, batch * 500
        request = random_request(rng)
        narrowed = GoodputPolicy().choose_pair(prefills, decodes, request)
        full = GoodputPolicy(narrowing=FULL).choose_pair(prefills, decodes, request)
        assert (narrowed.prefill, narrowed.decode) == (full.prefill, full.decode)


def test_the_prefix_holder_is_always_a_candidate_however_loaded():
    rng = random.Random(1)
    narrowing = Narrowing()
    for _ in range(50):
        prefills, _ = random_pools(rng, 200, 1, mixed=False)
        holder = rng.choice(prefills)
        holder.warm, holder.queued_prefill_tokens = frozenset(range(8)), 10**6  # the most loaded of all
        candidates = narrowing.narrow(prefills, prefill_load, rng, tuple(range(8)))
        assert holder in candidates and len(candidates) == narrowing.candidates


def test_of_many_holders_those_with_the_longest_prefix_are_candidates():
    prefills = [Inst(f"p{i}", warm=frozenset(range(2)), queued_prefill_tokens=0) for i in range(100)]
    longest = prefills[37]
    longest.warm, longest.queued_prefill_tokens = frozenset(range(8)), 5000
    candidates = Narrowing().narrow(prefills, prefill_load, random.Random(0), tuple(range(8)))
    assert longest in candidates


def test_a_long_cached_prefix_on_a_loaded_instance_wins_among_many():
    prefills, decodes = random_pools(random.Random(3), 128, 128, mixed=False)
    holder = prefills[100]
    holder.warm, holder.queued_prefill_tokens = frozenset(range(100)), 500
    request = RequestShape(1600, 50, SLO(1000.0, 50.0), blocks_needed=4, block_hashes=tuple(range(100)))
    choice = GoodputPolicy().choose_pair(prefills, decodes, request)
    assert choice.prefill is holder and choice.cached_tokens == 1600


def test_a_decision_at_512x512_makes_a_bounded_number_of_predictions_and_options(monkeypatch):
    built = []
    monkeypatch.setattr(goodput, "_Option", lambda *a, **k: built.append(1) or _real_option(*a, **k))
    rng = random.Random(512)
    prefills, decodes = random_pools(rng, 512, 512)
    policy = GoodputPolicy(local_prefill_max_tokens=256)
    for _ in range(20):
        built.clear()
        for inst in prefills + decodes:
            inst.predictions = 0
        assert policy.choose_pair(prefills, decodes, random_request(rng)) is not None
        # each candidate predicted once (a decode one twice with a local option: TTFT and TPOT)
        assert sum(inst.predictions for inst in prefills) <= CANDIDATES
        assert sum(inst.predictions for inst in decodes) <= 2 * CANDIDATES
        assert len(built) <= CANDIDATES * CANDIDATES + CANDIDATES  # the candidates' pairs at most, then local options


_real_option = goodput._Option


def test_the_full_search_predicts_every_instance_once():
    prefills, decodes = random_pools(random.Random(5), 64, 64, mixed=False)
    GoodputPolicy(narrowing=FULL).choose_pair(prefills, decodes, RequestShape(100, 50, SLO(1000.0, 50.0)))
    assert all(inst.predictions == 1 for inst in prefills + decodes)


def test_a_colocated_pool_is_narrowed_too():
    pool = [Inst(f"c{i}", queued_prefill_tokens=100 + i, decode_batch=10) for i in range(300)]
    pool[250].queued_prefill_tokens, pool[250].decode_batch = 0, 0
    choice = GoodputPolicy().choose_pair(pool, pool, RequestShape(100, 50, SLO(1000.0, 50.0)))
    assert choice.prefill is choice.decode is pool[250]
    assert sum(inst.predictions for inst in pool) <= 2 * CANDIDATES


def test_the_draws_are_seeded():
    def choices(seed: int) -> list[str]:
        rng = random.Random(9)
        policy = GoodputPolicy(narrowing=Narrowing(seed=seed))
        pools = random_pools(rng, 100, 100)
        return [policy.choose_pair(*pools, random_request(rng)).prefill.instance_id for _ in range(30)]

    assert choices(1) == choices(1)


# ---- settings -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "settings, field",
    [({"candidates": -1}, "candidates"), ({"holders": -2}, "holders"), ({"sampled": 1.5}, "sampled"),
     ({"candidates": 6, "holders": 4, "sampled": 2}, "candidates")],
)  # fmt: skip
def test_a_bad_narrowing_is_a_value_error_naming_the_field(settings, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        Narrowing(**settings)


@pytest.mark.parametrize("value", [-1, 3])
def test_a_bad_placement_candidates_is_refused_naming_it(value):
    with pytest.raises(InvalidRequestError) as error:
        ServingConfig.from_dict({"placement_candidates": value})
    assert error.value.field == "placement_candidates" and isinstance(error.value, ValueError)


def test_the_config_sets_the_candidates():
    assert placement_policy(ServingConfig.from_dict({"placement_candidates": 0})).narrowing.candidates == 0
    assert placement_policy(ServingConfig()).narrowing == Narrowing()


def test_in_an_idle_pool_cold_prefixes_spread_and_each_keeps_its_place():
    """As the full search's rendezvous hashing: the next request with a prefix (before any report
    says who holds it) goes where the first one went, and different prefixes go to different places."""
    prefills, decodes = random_pools(random.Random(0), 100, 100, mixed=False)
    for inst in prefills + decodes:
        inst.queued_prefill_tokens = inst.decode_batch = inst.decode_context_tokens = 0
    policy = GoodputPolicy()

    def place(first: int):
        choice = policy.choose_pair(
            prefills, decodes, RequestShape(256, 50, SLO(1000.0, 50.0), block_hashes=(first, 7))
        )
        return choice.prefill, choice.decode

    places = [place(first) for first in range(60)]
    assert len({p for p, _ in places}) > 30
    assert [place(first) for first in range(60)] == places


def test_the_decode_instance_holding_a_conversation_takes_its_next_turn_locally():
    """Issue 54, decode-side reuse: with conditional disaggregation on, the decode instance whose
    cache holds the conversation (the prefix index lists it) is a candidate in a large pool, and
    prefills only the new turn's tokens itself."""
    prefills, decodes = random_pools(random.Random(5), 4, 64, mixed=False)
    for d in decodes[:40]:  # the least loaded are others
        d.decode_batch, d.decode_context_tokens = 0, 0
    for d in decodes[40:]:
        d.decode_batch, d.decode_context_tokens = 2, 2 * 100
    holder = decodes[41]  # its previous answer done, its history cached
    holder.warm, holder.decode_batch, holder.decode_context_tokens = frozenset(range(30)), 0, 0
    request = RequestShape(30 * 16 + 40, 16, SLO(60.0, 0.0), block_hashes=tuple(range(30)))  # TTFT 60 ms
    choice = GoodputPolicy(local_prefill_max_tokens=256).choose_pair(prefills, decodes, request)
    assert choice.local and choice.decode is holder and choice.cached_tokens == 30 * 16
    without = GoodputPolicy(local_prefill_max_tokens=0).choose_pair(prefills, decodes, request)
    assert not without.local  # off: the prompt goes to the prefill pool whole
