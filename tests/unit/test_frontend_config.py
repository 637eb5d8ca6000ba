"""`frontends: N` (ServingConfig): each frontend's ports and start-up, and its share of the
in-flight bound (the frontends themselves: tests/integration/test_frontends.py)."""

import pytest

from disagg.config import ServingConfig


def test_frontend_i_listens_on_port_plus_i_and_sends_no_start_up_requests():
    config = ServingConfig(frontends=3, port=50051, http_port=8000, metrics_port=9100)
    assert config.frontend(0) is config
    second = config.frontend(2)
    assert (second.port, second.http_port, second.metrics_port) == (50053, 8002, 9102)
    assert not second.warm_up and second.calibration_s == 0


def test_ephemeral_and_absent_ports_stay_so():
    config = ServingConfig(frontends=2, port=0, http_port=0, metrics_port=None)
    other = config.frontend(1)
    assert (other.port, other.http_port, other.metrics_port) == (0, 0, None)


def test_each_frontend_admits_its_share_of_the_inflight_bound():
    assert ServingConfig(max_inflight_requests=256).frontend_inflight_limit() == 256
    assert ServingConfig(max_inflight_requests=256, frontends=2).frontend_inflight_limit() == 128
    assert ServingConfig(max_inflight_requests=5, frontends=2).frontend_inflight_limit() == 3
    assert ServingConfig(max_inflight_requests=1, frontends=4).frontend_inflight_limit() == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_frontends_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="frontends"):
        ServingConfig(frontends=bad)
