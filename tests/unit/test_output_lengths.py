"""What the router expects a request to write (disagg.router.output_lengths), and the TPOT
prediction taking it instead of max_tokens (pure: no server)."""

from __future__ import annotations

import pytest

from disagg.config import ServingConfig
from disagg.placement.goodput import GoodputPolicy
from disagg.placement.policies import RequestShape
from disagg.slo import SLO
from disagg.ranking.ranker import LengthRanker
from disagg.router.migration import Progress
from disagg.router.output_lengths import OutputLengths
from disagg.request import SamplingParams
from tests.unit.test_goodput_policy import Inst

CHAT_ASKING_FOR_ROOM = 1024  # what a client allows; an answer is usually far shorter


def test_max_tokens_is_expected_unless_the_ranker_is_asked_for():
    assert OutputLengths.from_config(ServingConfig()).expected([1, 2, 3], 700) == 700
    lengths = OutputLengths.from_config(ServingConfig.from_dict({"output_length": "ranker"}))
    assert isinstance(lengths.ranker, LengthRanker)
    predicted = lengths.expected([5, 6, 7, 8], CHAT_ASKING_FOR_ROOM)
    assert 1 <= predicted < CHAT_ASKING_FOR_ROOM  # the bundled ranker's lengths run to 256
    assert lengths.expected([5, 6, 7, 8], 3) <= 3  # never past what the request may write


def test_an_unknown_output_length_setting_is_refused():
    with pytest.raises(ValueError, match="output_length"):
        ServingConfig.from_dict({"output_length": "oracle"})


def test_the_ranker_orders_a_one_word_answer_before_an_essay():
    lengths = OutputLengths.from_config(ServingConfig.from_dict({"output_length": "ranker"}))
    from disagg.bench.workloads import load_tokenizer  # the default model's, as the bundled ranker's

    tokenizer, _ = load_tokenizer(None)

    def chat(text: str) -> list[int]:
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
            )
        )

    short, long = chat("Answer yes or no: is ice cold?"), chat("Write a long essay about the history of bridges.")
    assert lengths.expected(short, CHAT_ASKING_FOR_ROOM) < lengths.expected(long, CHAT_ASKING_FOR_ROOM)


def test_a_shorter_expected_output_predicts_a_lower_tpot_on_a_busy_instance():
    busy = Inst("d0", decode_batch=16, decode_context_tokens=16 * 300)
    policy = GoodputPolicy()
    slo = SLO(10_000.0, 1_000.0)
    by_max = RequestShape(100, CHAT_ASKING_FOR_ROOM, slo)
    by_prediction = RequestShape(100, CHAT_ASKING_FOR_ROOM, slo, expected_output_tokens=60)
    assert by_prediction.output_tokens == 60 and by_max.output_tokens == CHAT_ASKING_FOR_ROOM
    tpot_max = policy.choose_pair([Inst("p0")], [busy], by_max).tpot_ms
    tpot_predicted = policy.choose_pair([Inst("p0")], [busy], by_prediction).tpot_ms
    assert tpot_predicted < tpot_max


def test_after_a_migration_the_rest_of_the_expectation_is_expected():
    progress = Progress([1, 2, 3], SamplingParams(max_tokens=100), expected_output_tokens=40)
    assert progress.attempt_expected_output() == 40
    progress.streamed.extend(range(30))
    assert progress.attempt_expected_output() == 10
    progress.streamed.extend(range(20))  # past the prediction: at least one more token
    assert progress.attempt_expected_output() == 1
    assert Progress([1], SamplingParams(max_tokens=5)).attempt_expected_output() is None


def test_an_ltr_decode_pool_gets_predictions_for_its_admission_order_not_for_tpot():
    ltr = ServingConfig.from_dict({"decode": {"engine": {"scheduling_order": "ltr"}}})
    lengths = OutputLengths.from_config(ltr)
    assert lengths.ranker is not None and not lengths.for_tpot
    assert lengths.predicted([5, 6, 7], 500) is not None
    assert lengths.expected([5, 6, 7], 500) == 500  # the TPOT prediction still takes max_tokens
