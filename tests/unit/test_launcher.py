"""The one deployment launcher (disagg.bench.launcher): what config a benchmark's deployment
runs, where it goes, and a start that fails saying why (a real `disagg serve` process, which
exits at its config check before it starts anything)."""

from __future__ import annotations

import pytest
import yaml

from disagg.bench.launcher import Deployment
from disagg.config import ServingConfig


def test_the_benchmarks_settings_go_over_the_base_config_as_serve_lays_flags_over_it(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"engine": {"max_num_seqs": 8, "block_size": 32}, "replan": True, "port": 1}))
    dep = Deployment({"engine": {"max_num_seqs": 4}, "replan": False}, base=str(base), workdir=tmp_path / "w")
    config = ServingConfig.from_dict(dep.config)
    assert (config.engine.max_num_seqs, config.engine.block_size, config.replan) == (4, 32, False)
    assert config.port not in (1, 50051) and config.metrics_port and config.http_port == 0  # free ports, no HTTP
    assert dep.http_url is None and dep.metrics_url == f"http://127.0.0.1:{config.metrics_port}/metrics"
    with_http = Deployment({}, http=True, workdir=tmp_path / "h")
    assert with_http.config["http_port"] > 0 and with_http.http_url.endswith(str(with_http.config["http_port"]))


def test_a_work_directory_it_made_itself_goes_with_it_and_one_given_stays(tmp_path):
    own = Deployment({})
    own.close()
    assert not own.workdir.exists()
    given = Deployment({}, workdir=tmp_path / "kept", name="mode-a", log=tmp_path / "logs" / "mode-a.log")
    given.close()
    assert given.workdir.is_dir() and given.config_path == tmp_path / "kept" / "mode-a.yaml"
    assert given.log == tmp_path / "logs" / "mode-a.log"


@pytest.mark.timeout(120)
def test_a_start_that_fails_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        with Deployment({"engine": {"max_num_seqs": 0}}, workdir=tmp_path):
            pass
    assert (tmp_path / "serve.yaml").exists()
