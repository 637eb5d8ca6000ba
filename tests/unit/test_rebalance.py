"""Rebalancing decode instances (disagg.placement.rebalance): requests move from a batch
predicted to miss its TPOT target to an instance with room, and never where they would make a
new miss or come back (pure: constructed instance states)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from disagg.placement.latency_model import Coefficients, StepModel
from disagg.placement.rebalance import batch_tpot_ms, rebalance

# a decode step: 10 ms + 0.01 ms per context token + 2 ms per request
MODEL = StepModel(Coefficients(5.0, 0.1, 0.0), Coefficients(10.0, 0.01, 2.0), Coefficients(10.0, 0.01, 2.0))


@dataclass
class Decode:
    instance_id: str
    contexts: list[int] = field(default_factory=list)  # of the requests decoding there
    residual_ms: float = 0.0
    step_model: StepModel = MODEL
    decode_calibrated: bool = True
    free_blocks: int = 1000

    @property
    def decode_batch(self) -> int:
        return len(self.contexts)

    @property
    def decode_context_tokens(self) -> int:
        return sum(self.contexts)

    def tpot_residual_ms(self, model_ms: float) -> float:
        return self.residual_ms


def plan(decodes, tpot_ms, **kw):
    requests = {id(d): [(d.instance_id, i, c) for i, c in enumerate(d.contexts)] for d in decodes}
    return rebalance(decodes, lambda d: requests[id(d)], lambda r: r[2], tpot_ms, **kw)


def test_the_batch_step_is_the_model_plus_the_residual():
    d = Decode("d", [100, 300], residual_ms=3.0)
    assert batch_tpot_ms(d) == pytest.approx(10 + 0.01 * 400 + 2 * 2 + 3)
    assert batch_tpot_ms(d, -1, -100) == pytest.approx(10 + 0.01 * 300 + 2 + 3)
    assert batch_tpot_ms(Decode("idle")) == 0.0


def test_an_instance_predicted_to_miss_hands_requests_to_one_with_room_until_it_fits():
    crowded, idle = Decode("crowded", [200] * 10), Decode("idle", [200])  # 50 ms and 14 ms
    moves = plan([crowded, idle], tpot_ms=40.0)
    assert moves and all(m.source is crowded and m.target is idle for m in moves)
    # after the moves the source fits, and the receiver is under the target with margin
    n = len(moves)
    assert batch_tpot_ms(crowded, -n, -200 * n) <= 40.0
    assert batch_tpot_ms(idle, n, 200 * n) <= 40.0 * 0.85
    assert n == 3  # 50 -> 46 -> 42 -> 38 ms: the third is the last it needs


def test_the_request_with_the_least_context_moves_first():
    crowded, idle = Decode("crowded", [900, 50, 400, 2000, 300, 700, 800, 600]), Decode("idle")
    moves = plan([crowded, idle], tpot_ms=70.0)
    assert [m.request[2] for m in moves] == sorted(crowded.contexts)[: len(moves)]


def test_nothing_moves_when_every_instance_fits_or_none_has_room():
    assert plan([Decode("a", [100] * 3), Decode("b", [100])], tpot_ms=40.0) == []  # all fit
    both_full = [Decode("a", [300] * 12), Decode("b", [300] * 11)]
    assert plan(both_full, tpot_ms=40.0) == []  # a move would make a new miss
    assert plan([Decode("a", [300] * 12), Decode("b")], tpot_ms=0.0) == []  # no target: nothing to miss
    assert plan([Decode("a", [300] * 12)], tpot_ms=40.0) == []  # nowhere to go


def test_a_round_is_stable_the_receiver_is_not_predicted_to_miss_so_nothing_comes_back():
    crowded, idle = Decode("crowded", [200] * 10), Decode("idle", [200])
    moves = plan([crowded, idle], tpot_ms=40.0)
    for m in moves:  # apply them
        crowded.contexts.remove(m.request[2])
        idle.contexts.append(m.request[2])
    assert plan([crowded, idle], tpot_ms=40.0) == []


def test_at_most_max_moves_a_round():
    crowded, idle = Decode("crowded", [10] * 40), Decode("idle")
    assert len(plan([crowded, idle], tpot_ms=60.0, max_moves=2)) == 2


def test_an_instance_predicted_on_a_guess_takes_no_part():
    crowded, idle = Decode("crowded", [200] * 10), Decode("idle", [200], decode_calibrated=False)
    assert plan([crowded, idle], tpot_ms=40.0) == []
    crowded.decode_calibrated, idle.decode_calibrated = False, True
    assert plan([crowded, idle], tpot_ms=40.0) == []
