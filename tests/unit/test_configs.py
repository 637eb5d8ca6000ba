"""Serving configs: the shipped examples parse, and bad settings are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from disagg.config import DEFAULT_MODEL, EngineConfig, Role, ServingConfig, WorkerConfig, read_yaml_settings
from disagg.planner.hardware import hardware_spec
from disagg.planner.memory import config_fit_errors
from disagg.planner.models import model_spec

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "deploy" / "configs").glob("*.yaml"))
# What each shipped GPU config is written for, as its header says: (hardware, the model's shape).
GPU_CONFIGS = {
    "llama3-8b-gpu.yaml": ("l40s", "llama3-8b"),
    "gpu-one.yaml": ("h200", "llama3-8b"),
    "gpu-one-colocated.yaml": ("h200", "llama3-8b"),
}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_configs_parse(path):
    config = shipped(path.name)
    assert config.mode in ("disaggregated", "colocated")


def test_examples_exist():
    assert {p.name for p in CONFIGS} >= {"disaggregated.yaml", "colocated.yaml", "colocated-prefill-first.yaml"}
    assert {p.name for p in CONFIGS} >= set(GPU_CONFIGS)


def shipped(name: str) -> ServingConfig:
    """With a key, as `disagg serve` runs it: a config that serves other machines takes its key
    from $DISAGG_API_KEY (deploy/head-serve.sh sets it), never from the file."""
    return ServingConfig.from_dict({"api_key": "k" * 32, **read_yaml_settings(str(CONFIGS[0].parent / name))})


def test_every_shipped_gpu_config_fits_its_hardware_by_the_engines_rule():
    """Each worker's weights, KV cache and activations fit its share of the GPU it is written for,
    less a tenth for the runtime: the rule the engine refuses a worker by at start."""
    on_gpus = {p.name for p in CONFIGS if any(pool.num_gpus_per_worker for _, pool in shipped(p.name).pools())}
    assert on_gpus == set(GPU_CONFIGS), "a new GPU config: name the hardware it is written for above"
    for name, (hardware, shape) in GPU_CONFIGS.items():
        config = shipped(name)
        errors = config_fit_errors(
            config, model_spec(shape), {role: hardware_spec(hardware) for role, _ in config.pools()}
        )
        assert errors == [], (name, errors)


def test_gpu_one_shares_one_gpu_between_a_prefill_and_a_decode_worker():
    config = shipped("gpu-one.yaml")
    pools = dict(config.pools())
    assert sum(p.num_instances * p.workers_per_instance * p.num_gpus_per_worker for p in pools.values()) == 1
    engines = {role: config.pool_engine_config(pool) for role, pool in pools.items()}
    assert all(e.gpu_memory_utilization == 0.5 for e in engines.values()), "each may take half the GPU's memory"
    assert all(e.device == "cuda" and e.dtype == "bfloat16" for e in engines.values())
    assert (engines["prefill"].model, engines["prefill"].tokenizer) == ("random:llama3-8b", DEFAULT_MODEL)
    assert not engines["decode"].enforce_eager, "decode steps replay CUDA graphs"
    assert engines["decode"].kv_cache_memory_bytes > engines["prefill"].kv_cache_memory_bytes
    assert config.slo.ttft_ms > 0 and config.slo.tpot_ms > 0


def test_gpu_one_colocated_is_the_same_service_on_the_whole_gpu():
    disaggregated, colocated = shipped("gpu-one.yaml"), shipped("gpu-one-colocated.yaml")
    ((role, pool),) = colocated.pools()
    engine, decode = colocated.pool_engine_config(pool), disaggregated.pool_engine_config(disaggregated.decode)
    assert role == "colocated" and pool.num_instances * pool.num_gpus_per_worker == 1
    same = ("model", "tokenizer", "dtype", "device", "max_model_len", "block_size")
    assert [getattr(engine, f) for f in same] == [getattr(decode, f) for f in same]
    assert colocated.slo == disaggregated.slo and engine.gpu_memory_utilization is None and not engine.enforce_eager


def test_the_tokenizer_the_gpu_configs_name_loads_and_fits_the_model():
    """random: weights have no tokenizer; the configs name the default model's, which must load
    beside a Llama-3-8B shape (its ids within the model's vocabulary)."""
    from disagg.engine.loader import load_model_source

    engine = shipped("gpu-one.yaml").engine
    source = load_model_source(engine.model, cache_dir=engine.cache_dir, tokenizer=engine.tokenizer)
    assert source.tokenizer is not None and len(source.tokenizer) <= source.config.vocab_size


@pytest.mark.parametrize(
    "data,field",
    [
        ({"mode": "split"}, "mode"),
        ({"prefil": {}}, "config"),
        ({"prefill": {"num_instances": 0}}, "num_instances"),
        ({"engine": {"block_size": 3}}, "block_size"),
        ({"decode": {"engine": {"max_num_seq": 3}}}, "engine"),
        ({"engine": {"scheduling_policy": "fifo"}}, "scheduling_policy"),
        ({"heartbeat_ttl_s": 0.5, "heartbeat_interval_s": 1}, "heartbeat_ttl_s"),
        ({"port": 70000}, "port"),
        ({"worker_host": "0.0.0.0"}, "worker_host"),
        ({"engine": {"attention_backend": "fast"}}, "attention_backend"),
        ({"engine": {"cpu_gemm": "mkl"}}, "cpu_gemm"),
        ({"prefill": {"num_instances": 1, "instances": [{}, {}]}}, "instances"),
        ({"prefill": {"instances": [{"threads": 2}]}}, "instances"),
        ({"prefill": {"instances": [{"threads_per_worker": 0}]}}, "instances"),
        ({"prefill": {"instances": [{"engine": {"max_num_seq": 3}}]}}, "instances"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_field(data, field):
    with pytest.raises(ValueError, match=field):
        ServingConfig.from_dict(data)


def test_unreadable_or_invalid_yaml(tmp_path):
    with pytest.raises(ValueError, match="config"):
        ServingConfig.from_yaml(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: [unclosed")
    with pytest.raises(ValueError, match="YAML"):
        ServingConfig.from_yaml(str(bad))


def test_a_bare_on_or_off_in_yaml_is_a_cpu_binding_not_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    for written, meant in (("on", "on"), ("off", "off"), ("auto", "auto"), ('"off"', "off")):
        path.write_text(f"cpu_binding: {written}\n")
        assert ServingConfig.from_yaml(str(path)).cpu_binding == meant


@pytest.mark.parametrize("value,shared", [("0", False), ("1", True), (None, True)])
def test_the_environment_gives_only_defaults(monkeypatch, value, shared):
    """DISAGG_KV_SHARED_MEMORY (and the other switches) set EngineConfig's default; a config
    that says otherwise wins."""
    if value is None:
        monkeypatch.delenv("DISAGG_KV_SHARED_MEMORY", raising=False)
    else:
        monkeypatch.setenv("DISAGG_KV_SHARED_MEMORY", value)
    assert EngineConfig().kv_shared_memory is shared
    assert EngineConfig(kv_shared_memory=not shared).kv_shared_memory is not shared


def test_a_worker_config_takes_the_services_kv_timeout_default_and_validates():
    config = WorkerConfig("p-0", "prefill", EngineConfig())
    assert config.role is Role.PREFILL and config.kv_timeout_s == ServingConfig().kv_timeout_s
    for bad, field in [
        (dict(kv_timeout_s=0), "kv_timeout_s"),
        (dict(role="router"), "role"),
        (dict(heartbeat_ttl_s=0.5), "heartbeat_ttl_s"),
    ]:
        with pytest.raises(ValueError, match=field):
            config.replace(**bad)


def test_the_default_admission_bound_is_what_the_decode_pool_runs_at_once():
    config = ServingConfig.from_dict({"engine": {"max_num_seqs": 32}, "decode": {"num_instances": 3}})
    assert config.inflight_limit() == 96
    colocated = ServingConfig.from_dict({"mode": "colocated", "colocated": {"num_instances": 2}})
    assert colocated.inflight_limit() == 2 * colocated.engine.max_num_seqs
    assert ServingConfig.from_dict({"max_inflight_requests": 7}).inflight_limit() == 7


def test_an_instance_may_differ_from_its_pool_in_threads_and_engine_settings():
    config = ServingConfig.from_dict(
        {
            "threads_per_worker": 1,
            "engine": {"max_num_batched_tokens": 256},
            "prefill": {
                "num_instances": 3,
                "instances": [{}, {"threads_per_worker": 2, "engine": {"max_num_seqs": 4}}],
            },
        }
    )
    pool = config.prefill
    assert [config.worker_threads(pool, i) for i in range(3)] == [1, 2, 1]
    assert [config.pool_engine_config(pool, i).max_num_seqs for i in range(3)] == [EngineConfig().max_num_seqs, 4,
                                                                                   EngineConfig().max_num_seqs]  # fmt: skip
    assert all(config.pool_engine_config(pool, i).max_num_batched_tokens == 256 for i in range(3))


TLS = {"tls_cert_file": "c.pem", "tls_key_file": "k.pem"}


@pytest.mark.parametrize(
    "listen",
    [{"host": "0.0.0.0"}, {"host": "10.1.2.3"}, {"http_host": "::"}, {"host": "gateway.internal"}],
)
def test_listening_openly_needs_a_key_or_client_certificates_or_insecure(listen):
    with pytest.raises(ValueError, match=next(iter(listen))):
        ServingConfig.from_dict(listen)
    for guard in ({"api_key": "k" * 16}, {**TLS, "tls_client_ca_file": "ca.pem"}, {"insecure": True}):
        ServingConfig.from_dict({**listen, **guard})


@pytest.mark.parametrize("listen", [{"host": "0.0.0.0"}, {"http_host": "10.1.2.3"}])
def test_tls_without_a_key_or_client_ca_is_refused_on_a_public_address(listen):
    """TLS encrypts, but a server certificate says nothing of who the client is."""
    with pytest.raises(ValueError, match="with TLS but with neither api_key nor client certificates"):
        ServingConfig.from_dict({**listen, **TLS})


def test_client_certificates_need_tls():
    with pytest.raises(ValueError, match="tls_client_ca_file"):
        ServingConfig.from_dict({"tls_client_ca_file": "ca.pem"})


def test_loopback_and_a_closed_http_port_need_nothing():
    for listen in (
        {"host": "127.0.0.1"},
        {"host": "::1"},
        {"host": "localhost"},
        {"http_host": "0.0.0.0", "http_port": 0},
    ):
        ServingConfig.from_dict(listen)


def test_serve_takes_the_key_from_the_environment(tmp_path, monkeypatch):
    """`disagg serve` with a config that listens openly and holds no key: $DISAGG_API_KEY's."""
    from disagg import server

    path = tmp_path / "open.yaml"
    path.write_text("host: 0.0.0.0\n")
    served = []
    monkeypatch.setattr(server, "serve", lambda config, ready_file: served.append(config) or 0)
    with pytest.raises(ValueError, match="host"):
        server.main_serve(str(path), {})
    monkeypatch.setenv("DISAGG_API_KEY", "a-key-from-the-environment")
    assert server.main_serve(str(path), {}) == 0
    assert served[0].api_key == "a-key-from-the-environment" and served[0].host == "0.0.0.0"
