"""The frontends' health verdict (disagg.router.health): the pools, and the controller past its grace."""

from __future__ import annotations

from disagg.router.health import HealthVerdict


def test_serving_while_the_pools_are_served_and_the_controller_lives():
    assert HealthVerdict(5.0).judge(True, True, now=0.0) is None


def test_an_empty_pool_is_not_serving_at_once():
    assert HealthVerdict(5.0).judge(False, True, now=0.0) == "a pool has no instance"


def test_a_controller_gone_turns_it_not_serving_only_after_the_grace():
    verdict = HealthVerdict(5.0)
    assert verdict.judge(True, False, now=100.0) is None, "within the grace: Ray may be restarting it"
    assert verdict.judge(True, False, now=104.0) is None
    assert "controller" in verdict.judge(True, False, now=105.0)
    assert verdict.problem is not None


def test_a_controller_back_within_the_grace_starts_the_grace_anew():
    verdict = HealthVerdict(5.0)
    verdict.judge(True, False, now=0.0)
    verdict.judge(True, True, now=4.0)
    assert verdict.judge(True, False, now=6.0) is None, "gone since 6 s, not since 0 s"
    assert verdict.judge(True, False, now=11.0) is not None


def test_redis_not_answering_is_not_the_controller_gone():
    verdict = HealthVerdict(1.0)
    assert verdict.judge(True, None, now=0.0) is None
    assert verdict.judge(True, None, now=50.0) is None
