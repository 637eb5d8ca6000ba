"""The output-length ranker (issue 39): its losses, its metric, its file, and the engine setting
each request's predicted length from it under `scheduling_order: ltr`."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from disagg import LLM, SamplingParams
from disagg.config import EngineConfig
from disagg.ranking.evaluation import kendall_tau_b
from disagg.ranking.features import feature_matrix, num_features, prompt_features
from disagg.ranking.losses import list_mle, pairwise_logistic
from disagg.ranking.ranker import DEFAULT_RANKER_FILE, LengthRanker
from disagg.ranking.train import TrainConfig, fit_ranker, split_records, train_scorer

BUCKETS = 256  # few enough to train in a blink, enough that the toy's kind tokens rarely collide


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # after conftest's: these are small tensors
    yield


def _toy_records(n: int, seed: int = 0) -> list[dict]:
    """Prompts whose output length is a known function of their words: the length grows with
    which 'kind' token (10..19) the prompt holds; the rest is noise tokens (100..199)."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        kind = rng.randrange(10)
        noise = [rng.randrange(100, 200) for _ in range(rng.randint(2, 8))]
        records.append({"prompt_token_ids": [1, 10 + kind, *noise], "output_len": 5 + 20 * kind})
    return records


# ---- losses -----------------------------------------------------------------------------------
def test_list_mle_prefers_the_true_order_to_its_reverse():
    lengths = torch.tensor([3.0, 50.0, 10.0, 200.0])
    right = torch.tensor([0.0, 2.0, 1.0, 3.0])  # higher score for the longer output
    assert list_mle(right, lengths) < list_mle(-right, lengths)
    assert pairwise_logistic(right, lengths) < pairwise_logistic(-right, lengths)


def test_list_mle_is_the_plackett_luce_likelihood_of_the_order():
    scores, lengths = torch.tensor([0.5, -1.0, 2.0]), torch.tensor([2.0, 1.0, 3.0])
    # The true order (longest first) is items 2, 0, 1.
    s2, s0, s1 = 2.0, 0.5, -1.0
    expected = -(s2 - math.log(math.exp(s2) + math.exp(s0) + math.exp(s1)) + s0 - math.log(math.exp(s0) + math.exp(s1)))
    assert list_mle(scores, lengths).item() == pytest.approx(expected, rel=1e-6)


def test_losses_take_a_batch_of_lists_and_pairwise_ignores_ties():
    scores = torch.randn(4, 8)
    assert list_mle(scores, torch.rand(4, 8)).shape == ()
    assert pairwise_logistic(scores, torch.ones(4, 8)).item() == 0.0  # all tied: no pair to order


def test_list_mle_training_decreases_the_loss_and_learns_the_order():
    records = _toy_records(200)
    features = feature_matrix([r["prompt_token_ids"] for r in records], BUCKETS)
    lengths = np.array([r["output_len"] for r in records])
    x, y = torch.from_numpy(features), torch.from_numpy(lengths.astype(np.float32))
    before = list_mle(x @ torch.zeros(x.shape[1]), y).item()
    weight, _ = train_scorer(features, lengths, TrainConfig(steps=150, num_buckets=BUCKETS))
    # Ten groups of ~20 tied lengths: a list of ties has no order to learn, so the loss cannot
    # fall near zero (its floor is about 10 * log(20!), half the start).
    assert list_mle(x @ weight, y).item() < 0.9 * before
    assert kendall_tau_b((x @ weight).tolist(), lengths.tolist()) > 0.8


# ---- Kendall's tau-b ---------------------------------------------------------------------------
def test_kendall_tau_is_one_for_the_same_order_and_minus_one_for_the_reverse():
    assert kendall_tau_b([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau_b([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0


def test_kendall_tau_b_counts_ties():
    # Pair (0, 1) is tied in x, pair (2, 3) in y, the other 4 are concordant: 4 / sqrt(5 * 5).
    assert kendall_tau_b([1, 1, 2, 3], [1, 2, 3, 3]) == pytest.approx(4 / 5)
    assert math.isnan(kendall_tau_b([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError):
        kendall_tau_b([1, 2], [1])


# ---- features and the ranker's file ------------------------------------------------------------
def test_features_are_a_unit_bag_and_the_log_length():
    f = prompt_features([5, 6, 7, 5], BUCKETS)
    assert f.shape == (num_features(BUCKETS),)
    assert np.linalg.norm(f[:BUCKETS]) == pytest.approx(1.0)
    assert f[BUCKETS] > prompt_features([5], BUCKETS)[BUCKETS]  # longer prompt, larger length feature


def test_save_and_load_give_the_same_scores_and_lengths(tmp_path):
    ranker = fit_ranker(_toy_records(100), TrainConfig(steps=30, num_buckets=BUCKETS))
    path = tmp_path / "ranker.pt"
    ranker.save(path)
    loaded = LengthRanker.load(path)
    for record in _toy_records(20, seed=1):
        ids = record["prompt_token_ids"]
        assert loaded.score(ids) == ranker.score(ids)
        assert loaded.predict_len(ids) == ranker.predict_len(ids)


def test_predicted_lengths_follow_the_scores_within_the_data_range():
    ranker = fit_ranker(_toy_records(200), TrainConfig(steps=150, num_buckets=BUCKETS))
    short, long = [1, 10, 150, 151], [1, 19, 150, 151]
    assert ranker.score(short) < ranker.score(long)
    assert 5 <= ranker.predict_len(short) < ranker.predict_len(long) <= 185


@pytest.mark.parametrize("content", [None, b"not a torch file", "wrong dict"])
def test_a_missing_or_foreign_file_is_a_value_error(tmp_path, content):
    path = tmp_path / "ranker.pt"
    if content == "wrong dict":
        torch.save({"weight": torch.zeros(3)}, path)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match="length ranker"):
        LengthRanker.load(path)


def test_the_split_uses_the_datas_heldout_words_else_a_random_fifth():
    records = [
        {"prompt_token_ids": [1], "output_len": i, "split": "heldout" if i % 5 == 4 else "train"} for i in range(50)
    ]
    train, heldout, how = split_records(records)
    assert (len(train), len(heldout), how) == (40, 10, "held-out word banks")
    assert all(r["split"] == "heldout" for r in heldout)
    train, heldout, how = split_records([{"prompt_token_ids": [1], "output_len": i} for i in range(50)])
    assert (len(train), len(heldout), how) == (40, 10, "random 20%")


# ---- the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def toy_ranker_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("ranker") / "toy.pt"
    fit_ranker(_toy_records(200), TrainConfig(steps=150, num_buckets=BUCKETS)).save(path)
    return str(path)


def _tiny_llm(**settings) -> LLM:
    return LLM(model="random:tiny", dtype="float32", num_kv_blocks=16, max_model_len=64, **settings)


def test_the_engine_under_ltr_predicts_each_added_requests_length(toy_ranker_file):
    engine = _tiny_llm(scheduling_order="ltr", length_ranker=toy_ranker_file).engine
    params = SamplingParams(max_tokens=40)
    short = engine.add_request("short", prompt_token_ids=[1, 10, 150], sampling_params=params)
    long = engine.add_request("long", prompt_token_ids=[1, 19, 150], sampling_params=params)
    assert short.predicted_output_len < long.predicted_output_len <= 40  # capped at max_tokens
    for rid in ("short", "long"):
        engine.abort_request(rid)


def test_the_engine_under_fcfs_loads_and_predicts_nothing():
    engine = _tiny_llm().engine
    assert engine.length_ranker is None
    assert engine.add_request("r", prompt_token_ids=[1, 2, 3]).predicted_output_len is None
    engine.abort_request("r")


@pytest.mark.skipif(not DEFAULT_RANKER_FILE.is_file(), reason="the bundled ranker is not trained yet")
def test_ltr_without_a_ranker_file_uses_the_bundled_one():
    engine = _tiny_llm(scheduling_order="ltr").engine
    assert engine.add_request("r", prompt_token_ids=[1, 2, 3]).predicted_output_len >= 1
    engine.abort_request("r")


def test_a_bad_length_ranker_setting_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="length_ranker"):
        EngineConfig(scheduling_order="ltr", length_ranker="")
    with pytest.raises(ValueError, match="length_ranker"):
        EngineConfig(length_ranker="ranker.pt")  # fcfs reads no ranker: a setting that does nothing
    with pytest.raises(ValueError, match="length_ranker"):
        _tiny_llm(scheduling_order="ltr", length_ranker=str(tmp_path / "missing.pt"))
