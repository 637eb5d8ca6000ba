"""deploy/cluster.yaml and deploy/cluster-aws.yaml as Ray's cluster launcher reads them (its own
schema and defaults; `make deploy-test` runs the local one for real)."""

from __future__ import annotations

import getpass
import subprocess
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from disagg.config import API_KEY_ENV, ServingConfig, read_yaml_settings

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


def test_the_aws_file_puts_each_tensor_parallel_group_on_one_node_and_serves_safely(monkeypatch):
    """The config it serves listens for other machines: it holds TLS and takes the key from the
    head (never from the repository): without it, it does not start. Each TP group fits the
    GPUs of its pool's node type."""
    from disagg.server import serving_config

    config = launcher_config("cluster-aws.yaml")
    path = str(DEPLOY / "configs" / "llama3-8b-gpu.yaml")
    assert "api_key" not in read_yaml_settings(path)
    with pytest.raises(ValueError, match="with TLS but with neither api_key nor client certificates"):
        ServingConfig.from_yaml(path)
    monkeypatch.setenv(API_KEY_ENV, "k" * 32)  # as deploy/head-serve.sh sets it from ~/disagg-api-key
    served = serving_config(path, {})
    assert config["file_mounts"]["~/disagg-plan.yaml"] == "./deploy/configs/llama3-8b-gpu.yaml"
    assert served.host == "0.0.0.0" and served.tls_cert_file and served.api_key == "k" * 32 and not served.insecure
    assert "~/disagg-api-key" in config["file_mounts"] and "~/disagg-tls" in config["file_mounts"]
    types = config["available_node_types"]
    for role, node_type in (("prefill", "prefill_gpu"), ("decode", "decode_gpu")):
        pool = getattr(served, role)
        gpus = GPUS_PER_INSTANCE_TYPE[types[node_type]["node_config"]["InstanceType"]]
        assert pool.tensor_parallel_size * pool.num_gpus_per_worker <= gpus, role
    assert any("deploy/download-model.sh" in c for c in config["worker_setup_commands"])


def test_the_aws_head_holds_neither_the_model_nor_the_token_that_downloads_it():
    """The GPU nodes download the model with a token that only their IAM role may read (SSM);
    the head, which holds whatever file_mounts copies, gets no token and runs no download: its
    frontend takes the model's shape and tokenizer from a worker (test_model_on_workers_only.py)."""
    config = launcher_config("cluster-aws.yaml")
    assert set(config["file_mounts"]) == {"~/.ray/auth_token", "~/disagg-plan.yaml", "~/disagg-api-key", "~/disagg-tls"}
    head = config["head_setup_commands"] + config["head_start_ray_commands"]
    assert not [c for c in head if "/models" in c or "hf " in c or "download" in c or "hf-token" in c], head
    download = [c for c in config["worker_setup_commands"] if "download-model.sh" in c]
    served = read_yaml_settings(str(DEPLOY / "configs" / "llama3-8b-gpu.yaml"))["engine"]["model"]
    assert len(download) == 1 and f" {served} " in download[0] and download[0].split()[-1] == "/disagg/hf-token"
    types = config["available_node_types"]
    assert "IamInstanceProfile" not in types["head"]["node_config"]  # Ray's own role, which may not read it
    gpu_roles = {t["node_config"]["IamInstanceProfile"]["Name"] for name, t in types.items() if name != "head"}
    assert gpu_roles == {"disagg-gpu-node"}
    assert "rm -rf ~/disagg-api-key ~/disagg-tls" in config["worker_setup_commands"]


def fake_commands(bin_dir: Path, record: Path) -> None:
    """Stand-ins for what download-model.sh calls on an EC2 node: the metadata service (curl),
    SSM (aws), sudo, and `hf`, which records its environment's token and its arguments."""
    scripts = {
        "curl": 'case "$*" in *api/token*) echo session;; *placement/region*) echo us-west-2;; *) exit 22;; esac',
        "aws": '[ "$*" = "ssm get-parameter --region us-west-2 --name /disagg/hf-token --with-decryption '
        '--query Parameter.Value --output text" ] && echo hf_secret || exit 1',
        "sudo": '"$@"',
        "hf": f'echo "token=${{HF_TOKEN:-}} args=$*" >> {record}; touch "$4/config.json"',
    }
    bin_dir.mkdir()
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)


def test_a_gpu_node_downloads_the_model_once_with_the_token_only_in_the_downloads_environment(tmp_path):
    record = tmp_path / "hf-calls"
    fake_commands(tmp_path / "bin", record)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "USER": getpass.getuser()}
    script = [str(DEPLOY / "download-model.sh"), "meta-llama/Meta-Llama-3-8B-Instruct", str(tmp_path / "m")]
    run = subprocess.run(script + ["/disagg/hf-token"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    call = f"args=download meta-llama/Meta-Llama-3-8B-Instruct --local-dir {tmp_path / 'm'} --exclude original/*"
    assert record.read_text().splitlines() == [f"token=hf_secret {call}"]
    assert "hf_secret" not in run.stdout + run.stderr
    again = subprocess.run(script + ["/disagg/hf-token"], env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and len(record.read_text().splitlines()) == 1, "downloaded twice"
    (tmp_path / "m" / "config.json").unlink()
    public = subprocess.run(script, env=env, capture_output=True, text=True, timeout=60)
    assert public.returncode == 0 and record.read_text().splitlines()[-1] == f"token= {call}", public.stderr
