from disagg.placement.prefill_rate import PrefillRate


def test_the_rate_follows_observations_and_predicts_a_queue():
    rate = PrefillRate(smoothing=0.5)
    assert rate.predict(1000) == 0.0  # nothing seen yet: no prediction
    rate.observe(1000, 2.0)
    assert rate.predict(500) == 1.0
    rate.observe(1000, 4.0)  # slower now: halfway there
    assert rate.predict(1000) == 3.0
    rate.observe(0, 5.0)  # nothing queued: nothing learned
    assert rate.predict(1000) == 3.0
