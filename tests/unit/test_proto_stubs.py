"""The committed gRPC stubs are exactly what `python proto/generate.py` produces (never hand-edited)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_current():
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "proto" / "generate.py"), "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_stubs_import_as_package():
    from disagg.v1 import serving_pb2, serving_pb2_grpc

    request = serving_pb2.GenerateRequest(prompt="hi", sampling=serving_pb2.SamplingParams(max_tokens=4))
    assert serving_pb2.GenerateRequest.FromString(request.SerializeToString()) == request
    assert hasattr(serving_pb2_grpc, "ServingStub")
    assert hasattr(serving_pb2_grpc, "add_ServingServicer_to_server")
