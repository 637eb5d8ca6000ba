"""A frontend needs no model files of its own: on a `ray up` cluster only the GPU nodes download
the model, and the head's `disagg serve` gets the model's shape and tokenizer from a worker
(disagg.engine.model_card). Here the frontend's process cannot see the model's path, the
workers can; a text prompt is tokenized by the frontend, and the answer is the offline engine's.

The Ray with a runtime environment of its own runs in a process of its own (model_on_workers_only.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from support import tiny_tokenizer

from disagg import LLM, SamplingParams

SCRIPT = Path(__file__).with_name("model_on_workers_only.py")
ROOT = Path(__file__).resolve().parents[2]  # this checkout's disagg, whatever the process's working directory
PROMPT = "hello world, the quick brown fox"


def test_the_frontend_starts_and_tokenizes_without_the_models_files(tiny_untied_dir, tmp_path):
    model_dir = tmp_path / "worker-home" / "models" / "tiny"
    shutil.copytree(tiny_untied_dir, model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    head_home = tmp_path / "head-home"
    (head_home / ".ray").mkdir(parents=True)
    (tmp_path / "worker-home" / ".ray").symlink_to(head_home / ".ray")  # Ray's token, on every node
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "HOME": str(head_home), "DISAGG_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": python_path}
    args = [sys.executable, str(SCRIPT), str(tmp_path / "worker-home"), PROMPT]
    run = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=str(head_home))
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["frontend_sees_the_model"] is False

    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    offline = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert result["token_ids"] == offline.token_ids and result["text"] == offline.text
