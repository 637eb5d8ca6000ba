"""Each Triton kernel of the CUDA path equals its torch code, run on CPU tensors by Triton's
interpreter: decode paged attention (triton_attention.py: sliding windows, grouped-query shapes),
RMSNorm with the residual, rotary fused with the KV write, and the gated activations
(triton_fused.py), in float32 and bfloat16. The cases are in triton_kernel_cases.py.

Triton reads TRITON_INTERPRET when it is imported (its own library functions, tl.sum among them,
are decorated then), so the cases run in a process of their own that sets it first. On a GPU the
compiled kernels are tested by tests/gpu.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TRITON_VERSION = "3.6.0"  # what `make setup` installs (the GPU machine's)
CASES = Path(__file__).with_name("triton_kernel_cases.py")
SUBPROCESS_TIMEOUT_S = 240


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason=f"Triton is not installed here (`make setup` installs triton=={TRITON_VERSION}; where its wheel "
    "does not install, the Triton kernels are not tested on this machine)",
)
def test_every_kernel_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    report = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    # every case ran: none skipped (no Triton, no interpreter), none failed
    assert " passed" in summary and not re.search(r"skipped|failed|error", summary), report
