"""deploy/cluster.yaml and deploy/cluster-aws.yaml as Ray's cluster launcher reads them (its own
schema and defaults; `make deploy-test` runs the local one for real)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from disagg.config import ServingConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def launcher_config(name: str) -> dict:
    config = prepare_config(yaml.safe_load((DEPLOY / name).read_text()))
    validate_config(config)
    return config


@pytest.mark.parametrize("name", ["cluster.yaml", "cluster-aws.yaml"])
def test_the_launcher_accepts_the_file_and_every_node_gets_the_token_and_the_path(name):
    config = launcher_config(name)
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert any("disagg/.venv/bin" in command and ".bashrc" in command for command in config["setup_commands"])
    assert any("head-serve.sh start" in command for command in config["head_start_ray_commands"])
    assert all(
        "RAY_AUTH_MODE=token" in c
        for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"]
        if "ray start" in c
    )


def test_the_local_file_labels_each_worker_machine_for_its_pool():
    config = launcher_config("cluster.yaml")
    start = " ".join(config["worker_start_ray_commands"])
    listed = start.split("node_labels", 1)[1].split(")")[0].split()
    workers = config["provider"]["worker_ips"]
    assert sorted(a for a in listed if not a.startswith("--")) == sorted(workers)  # every worker, once


def test_the_aws_file_has_a_gpu_node_type_per_pool_and_a_head_without_work():
    types = launcher_config("cluster-aws.yaml")["available_node_types"]
    assert types["head"]["resources"] == {"CPU": 0}
    assert types["prefill_gpu"]["resources"] == {"prefill": 1} and types["decode_gpu"]["resources"] == {"decode": 1}
    assert all(t["min_workers"] >= 1 for name, t in types.items() if name != "head")


GPUS_PER_INSTANCE_TYPE = {"g6e.xlarge": 1, "g6e.12xlarge": 4}  # AWS's figures


def test_the_aws_file_puts_each_tensor_parallel_group_on_one_node_and_serves_safely():
    """The config it serves listens for other machines: it holds TLS and takes the key from the
    head (never from the repository), and each TP group fits the GPUs of its pool's node type."""
    config = launcher_config("cluster-aws.yaml")
    served = ServingConfig.from_yaml(str(DEPLOY / "configs" / "llama3-8b-gpu.yaml"))
    assert config["file_mounts"]["~/disagg-plan.yaml"] == "./deploy/configs/llama3-8b-gpu.yaml"
    assert served.host == "0.0.0.0" and served.tls_cert_file and not served.api_key and not served.insecure
    assert "~/disagg-api-key" in config["file_mounts"] and "~/disagg-tls" in config["file_mounts"]
    types = config["available_node_types"]
    for role, node_type in (("prefill", "prefill_gpu"), ("decode", "decode_gpu")):
        pool = getattr(served, role)
        gpus = GPUS_PER_INSTANCE_TYPE[types[node_type]["node_config"]["InstanceType"]]
        assert pool.tensor_parallel_size * pool.num_gpus_per_worker <= gpus, role
    assert any("hf download" in c for c in config["worker_setup_commands"])
