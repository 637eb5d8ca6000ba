"""Run by test_model_on_workers_only.py in a process of its own (it needs a Ray of its own): the
service where the model's files are on the workers' side only, as on a `ray up` cluster whose
GPU nodes download the model and whose head never does. The model is `~/models/tiny`, and `~` is
a different directory for the workers (Ray's runtime environment sets their HOME) than for this
process, the frontend's, which must start and serve without reading any model file. Prints what
the test checks, as JSON.

    HOME=EMPTY_DIR python model_on_workers_only.py WORKER_HOME PROMPT
"""

from __future__ import annotations

import json
import os
import sys

import ray

from disagg.client import DisaggClient, generate_request
from disagg.config import ServingConfig
from disagg.server import Server

MODEL = "~/models/tiny"
MAX_TOKENS = 6


def main(worker_home: str, prompt: str) -> dict:
    python_path = os.environ.get("PYTHONPATH", "")
    env = {"HOME": worker_home, "PYTHONPATH": python_path, "DISAGG_WEIGHTS": "fp32"}
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": env}
    )
    try:
        return {"frontend_sees_the_model": os.path.exists(os.path.expanduser(MODEL)), **_serve(prompt)}
    finally:
        ray.shutdown()


def _serve(prompt: str) -> dict:
    pools = {role: {"num_cpus_per_worker": 0.5} for role in ("prefill", "decode")}
    engine = {"model": MODEL, "dtype": "float32", "num_kv_blocks": 64}
    settings = {"port": 0, "http_port": 0, "warm_up": False, "calibration_s": 0, "replan": False}
    with Server(ServingConfig.from_dict({"engine": engine, **pools, **settings})) as server:
        with DisaggClient(server.address) as client:
            request = generate_request(prompt=prompt, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            messages = list(client.stream(request, timeout=120))
    return {
        "token_ids": [t for m in messages for t in m.token_ids],
        "text": "".join(m.text for m in messages),
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
