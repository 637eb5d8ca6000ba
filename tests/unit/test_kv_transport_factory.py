"""One factory from the config's `kv_transport` to the transport workers build."""

from __future__ import annotations

import pytest

from disagg.config import DEFAULT_KV_TRANSPORT, KV_TRANSPORTS, EngineConfig, Role, ServingConfig, WorkerConfig
from disagg.errors import InvalidRequestError
from disagg.kv_transfer.factory import KV_TRANSPORT_CLASSES, make_transport
from disagg.kv_transfer.torch_dist import TorchDistTransport

KEY = bytes(range(32))


def test_every_transport_the_config_accepts_has_a_class():
    assert set(KV_TRANSPORT_CLASSES) == set(KV_TRANSPORTS)
    assert ServingConfig().kv_transport == DEFAULT_KV_TRANSPORT == "torch_dist"


def test_torch_dist_is_built_for_the_worker_on_its_host():
    transport = make_transport("torch_dist", "prefill-0", KEY, "127.0.0.1")
    try:
        assert type(transport) is TorchDistTransport
        assert transport.worker_id == "prefill-0" and transport.backend is None  # gloo or NCCL by device
        assert transport.address().startswith("127.0.0.1:")
    finally:
        transport.close()


def test_an_unknown_transport_is_a_value_error_naming_the_known_ones():
    with pytest.raises(ValueError, match="mooncake.*torch_dist"):
        make_transport("mooncake", "prefill-0", KEY)


def test_the_configs_refuse_an_unknown_transport():
    with pytest.raises(InvalidRequestError, match="kv_transport"):
        ServingConfig(kv_transport="mooncake")
    with pytest.raises(InvalidRequestError, match="kv_transport"):
        WorkerConfig("decode-0", Role.DECODE, EngineConfig(), kv_transport="mooncake")
