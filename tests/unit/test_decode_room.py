"""The wait for room on the decode side as part of a request's TTFT (disagg.router.decode_room),
and the goodput policy shedding on it: pure, a fake clock."""

from __future__ import annotations

from dataclasses import replace

from test_goodput_policy import Inst, shape

from disagg.placement.goodput import GoodputPolicy
from disagg.router.decode_admission import DecodeAdmission
from disagg.router.decode_room import WINDOW_S, DecodeRoom

CRITICAL, STANDARD = -1, 0


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def room(clock: Clock, order: str = "fcfs") -> DecodeRoom:
    return DecodeRoom(DecodeAdmission(order, aging_s=10.0, clock=clock), clock=clock)


def test_no_wait_while_nobody_waits_or_before_any_place_has_freed():
    clock = Clock()
    forecast = room(clock)
    for _ in range(5):
        forecast.freed()
    assert forecast.wait_ms(STANDARD, None) == 0.0  # the line is empty: a reservation is answered at once
    fresh = room(clock)
    fresh.admission.join(STANDARD, None)
    assert fresh.wait_ms(STANDARD, None) == 0.0  # no rate yet: no guess


def test_the_wait_is_those_ahead_over_the_rate_places_free_and_a_critical_request_skips_the_others():
    clock = Clock()
    forecast = room(clock)
    for _ in range(6):  # 6 places freed in the window: 0.2 a second
        forecast.freed()
    for _ in range(3):
        forecast.admission.join(STANDARD, None)
    assert forecast.wait_ms(STANDARD, None) == (3 + 1) / (6 / WINDOW_S) * 1e3
    assert forecast.wait_ms(CRITICAL, None) == 1 / (6 / WINDOW_S) * 1e3  # none of its class ahead
    clock.now += WINDOW_S + 1  # the frees age out of the window
    assert forecast.wait_ms(STANDARD, None) == 0.0


def test_under_ltr_only_the_shorter_predicted_go_first():
    clock = Clock()
    forecast = room(clock, "ltr")
    forecast.freed()
    for length in (10, 50, 300):
        forecast.admission.join(STANDARD, length)
    assert forecast.admission.ahead_of(STANDARD, 60) == 2
    assert forecast.admission.ahead_of(STANDARD, None) == 3


def test_the_policy_adds_the_wait_to_the_ttft_and_sheds_on_it_all_but_critical():
    busy = [Inst("d0", decode_batch=8)]  # not idle: something to shed
    waiting = replace(shape(ttft=4000), decode_wait_ms=5000.0)
    choice = GoodputPolicy().choose_pair([Inst("p0")], busy, waiting)
    assert not choice.admitted and choice.ttft_ms >= 5000.0
    assert choice.ttft_model_ms < 1000.0  # what the residuals learn against leaves the wait out
    assert GoodputPolicy().choose_pair([Inst("p0")], busy, replace(waiting, priority="critical")).admitted
    assert GoodputPolicy().choose_pair([Inst("p0")], busy, shape(ttft=4000)).admitted  # no wait, no refusal
