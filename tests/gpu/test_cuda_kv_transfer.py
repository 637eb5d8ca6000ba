"""KV between two processes on one GPU: by reference through CUDA IPC, over the real protocol
(KVSender -> TorchDistTransport -> KVReceiver). NCCL refuses two ranks on one device, so the
transport carries only headers and block references (gloo) and the receiver copies the blocks
straight out of the sender's cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "geometry",
    [
        ["--dtype", "float32", "--tokens", "50", "--layers", "3", "--heads", "2", "--head-dim", "16"],
        ["--dtype", "bfloat16", "--tokens", "1024", "--layers", "32", "--heads", "8", "--head-dim", "128"],
    ],
)
def test_kv_arrives_exactly_by_cuda_ipc(geometry):
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.kv.ipc", "--device", "cuda", "--check", "--repeats", "2", *geometry],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "by reference" in out.stdout, out.stdout
    assert "mismatched transfers: 0" in out.stdout, out.stdout
