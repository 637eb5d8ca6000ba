"""Every setting is a `disagg serve` flag, generated from the config dataclasses: a flag parses
into the config the same YAML gives, overrides the file, fails as a bad YAML value does, and
`--help` lists it with its doc and default."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from disagg import server
from disagg.cli import build_parser, main
from disagg.config import SET_BY_POOLS, EngineConfig, ServingConfig, merge_settings, setting_groups
from disagg.errors import InvalidRequestError
from disagg.settings.catalog import serving_settings
from disagg.settings.flags import settings_from_flags

# A few representative settings of each config class: (flags, the same settings as YAML).
SAME_SETTINGS = [
    (["--port", "50052", "--kv-timeout-s", "12.5"], {"port": 50052, "kv_timeout_s": 12.5}),
    (["--no-warm-up", "--replan"], {"warm_up": False, "replan": True}),
    (["--metrics-port", "9100", "--api-key", "12345"], {"metrics_port": 9100, "api_key": "12345"}),
    (["--drain-timeout-s", "5", "--start-timeout-s", "90"], {"drain_timeout_s": 5, "start_timeout_s": 90}),
    (["--engine.max-num-seqs", "64", "--engine.dtype", "bfloat16"], {"engine": {"max_num_seqs": 64, "dtype": "bfloat16"}}),
    (["--engine.no-enable-prefix-caching", "--engine.batch-invariant"],
     {"engine": {"enable_prefix_caching": False, "batch_invariant": True}}),
    (["--engine.num-kv-blocks", "32", "--engine.gpu-memory-utilization", "0.5"],
     {"engine": {"num_kv_blocks": 32, "gpu_memory_utilization": 0.5}}),
    (["--prefill.num-instances", "2", "--decode.num-gpus-per-worker", "0.5"],
     {"prefill": {"num_instances": 2}, "decode": {"num_gpus_per_worker": 0.5}}),
    (["--prefill.engine", '{"max_num_seqs": 8}', "--prefill.resources", '{"prefill": 1}'],
     {"prefill": {"engine": {"max_num_seqs": 8}, "resources": {"prefill": 1}}}),
    (["--decode.instances", '[{"threads_per_worker": 2}]'], {"decode": {"instances": [{"threads_per_worker": 2}]}}),
    (["--mode", "colocated", "--colocated.num-instances", "3"], {"mode": "colocated", "colocated": {"num_instances": 3}}),
    (["--slo.ttft-ms", "400", "--slo.tpot-ms", "50"], {"slo": {"ttft_ms": 400, "tpot_ms": 50}}),
]  # fmt: skip


def flag_config(flags: list[str], config_path: str | None = None) -> ServingConfig:
    """What `disagg serve [--config PATH] FLAGS` would serve."""
    return server.serving_config(config_path, settings_from_flags(build_parser().parse_args(["serve", *flags])))


def yaml_config(tmp_path, settings: dict) -> ServingConfig:
    path = tmp_path / "serving.yaml"
    path.write_text(yaml.safe_dump(settings))
    return ServingConfig.from_yaml(str(path))


@pytest.mark.parametrize("flags,settings", SAME_SETTINGS, ids=[" ".join(f[::2]) for f, _ in SAME_SETTINGS])
def test_flags_give_the_config_the_same_yaml_gives(tmp_path, monkeypatch, flags, settings):
    monkeypatch.delenv("DISAGG_API_KEY", raising=False)
    from_flags = flag_config(flags)
    assert from_flags == yaml_config(tmp_path, settings)
    assert from_flags != ServingConfig()  # each case changes something


def test_a_flag_overrides_the_file_which_overrides_the_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("DISAGG_API_KEY", raising=False)
    path = tmp_path / "serving.yaml"
    path.write_text("model: random:tiny\nport: 1234\nengine: {max_num_seqs: 8, block_size: 32}\nslo: {ttft_ms: 100}\n")
    config = flag_config(["--engine.max-num-seqs", "16", "--slo.tpot-ms", "20"], str(path))
    assert (config.port, config.engine.model, config.engine.block_size) == (1234, "random:tiny", 32)  # the file's
    assert (config.engine.max_num_seqs, config.slo.ttft_ms, config.slo.tpot_ms) == (16, 100, 20)  # flags over it
    assert config.http_port == ServingConfig().http_port  # neither: the default
    assert flag_config(["--engine.model", "random:small"], str(path)).engine.model == "random:small"


def test_todays_short_flags_keep_their_meaning():
    config = flag_config(
        ["--model", "random:tiny", "--port", "0", "--http-port", "0", "--mode", "colocated", "--frontends", "2"]
    )
    assert (config.engine.model, config.port, config.http_port) == ("random:tiny", 0, 0)
    assert (config.mode, config.frontends) == ("colocated", 2)


def test_null_unsets_a_setting_that_may_be_unset(tmp_path):
    path = tmp_path / "serving.yaml"
    path.write_text("redis_url: redis://elsewhere:6379\nengine: {num_kv_blocks: 64}\n")
    config = flag_config(["--redis-url", "null", "--engine.num-kv-blocks", "null"], str(path))
    assert config.redis_url is None and config.engine.num_kv_blocks is None


@pytest.mark.parametrize(
    "flags,yaml_settings",
    [
        (["--engine.max-num-seqs", "0"], {"engine": {"max_num_seqs": 0}}),
        (["--engine.max-num-seqs", "many"], {"engine": {"max_num_seqs": "many"}}),
        (["--mode", "sideways"], {"mode": "sideways"}),
        (["--slo.ttft-ms", "-5"], {"slo": {"ttft_ms": -5}}),
        (["--decode.num-cpus-per-worker", "one"], {"decode": {"num_cpus_per_worker": "one"}}),
        (["--prefill.engine", '{"max_num_seq": 3}'], {"prefill": {"engine": {"max_num_seq": 3}}}),
        (["--heartbeat-ttl-s", "0.5"], {"heartbeat_ttl_s": 0.5}),
    ],
)
def test_a_bad_flag_value_fails_as_the_same_yaml_value_does(tmp_path, capsys, flags, yaml_settings):
    with pytest.raises(InvalidRequestError) as from_yaml:
        yaml_config(tmp_path, yaml_settings)
    assert main(["serve", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"error: {from_yaml.value}"


def test_a_flag_that_needs_json_says_so(capsys):
    assert main(["serve", "--prefill.resources", "{prefill: 1"]) == 2
    assert re.match(r"error: resources: must be JSON \(.*\), got '\{prefill: 1'", capsys.readouterr().err)


def test_every_field_of_the_config_tree_is_a_setting_with_a_doc():
    """Walked here apart from the catalog, so that a field it missed fails."""
    expected = {f.name for f in dataclasses.fields(ServingConfig) if f.name not in setting_groups()}
    for group, cls in setting_groups().items():
        names = [f.name for f in dataclasses.fields(cls) if not (cls is EngineConfig and f.name in SET_BY_POOLS)]
        expected |= {f"{group}.{name}" for name in names}
    settings = serving_settings()
    assert {s.key for s in settings} == expected
    assert len(expected) > 100
    assert [s.key for s in settings if len(s.doc) < 15] == []


def test_help_lists_every_setting_with_its_doc_and_default(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    squeezed = re.sub(r"\s+", "", text)
    for setting in serving_settings():
        assert re.search(rf"^\s+{re.escape(setting.flag)}\b", text, re.M), setting.flag
        assert re.sub(r"\s+", "", f"{setting.doc} (default: {setting.default})") in squeezed, setting.key
    assert "--engine.no-enable-prefix-caching" in text and "--model" in text


def test_merging_settings_goes_into_groups_and_replaces_mappings_whole():
    base = {"model": "a", "engine": {"seed": 1}, "prefill": {"resources": {"x": 1}, "num_instances": 2}}
    merged = merge_settings(base, {"prefill": {"resources": {"y": 1}}, "engine": {"max_num_seqs": 4}})
    assert merged == {
        "engine": {"seed": 1, "model": "a", "max_num_seqs": 4},
        "prefill": {"resources": {"y": 1}, "num_instances": 2},
    }
    assert merge_settings({"engine": {"model": "a"}}, {"model": "b"})["engine"]["model"] == "b"
