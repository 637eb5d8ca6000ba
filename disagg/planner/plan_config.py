"""A search's best candidate as a serving config (the YAML `disagg serve --config` reads)."""

from __future__ import annotations

import json

from disagg.config import POOL_LABEL_SLIVER
from disagg.planner.hardware import threads_per_rank
from disagg.planner.memory import kv_bytes_per_token_per_device
from disagg.planner.models import model_spec
from disagg.slo import SLO

BLOCK_SIZE = 16


def serving_config_dict(candidate, model: str, slo: SLO, kinds, serve_model: str | None = None) -> dict:
    """Mode, model, each pool's shape, instance count, devices, scheduler and KV memory, and the SLO.
    `model` is the shape planned for, `serve_model` the spec the engine loads (default: `model`).
    On a cluster of several node kinds each pool is pinned to its hardware's label and the config
    joins the running cluster: a Ray we start has no such labels."""
    config = model_spec(model)
    plan = {"mode": candidate.mode, "engine": {"model": serve_model or model, "block_size": BLOCK_SIZE}}
    for role, pool in candidate.pools.items():
        plan[role] = _pool_dict(config, pool)
        if is_mixed(kinds):
            plan[role]["resources"] = {hardware_label(pool.hardware): POOL_LABEL_SLIVER}
    _add_threads(plan, candidate)
    if is_mixed(kinds):
        plan["ray_address"] = "auto"
    plan["slo"] = slo.to_dict()
    return plan


def _pool_dict(config, pool) -> dict:
    on_gpu = not pool.hardware.startswith("cpu")
    dtype_bytes = 2 if on_gpu else 4  # bfloat16 on GPU, float32 on CPU (the engine's "auto")
    kv_bytes = pool.num_kv_blocks * BLOCK_SIZE * kv_bytes_per_token_per_device(config, pool.tp, pool.pp, dtype_bytes)
    return {
        "num_instances": pool.instances,
        "tensor_parallel_size": pool.tp,
        "pipeline_parallel_size": pool.pp,
        "num_cpus_per_worker": 1,
        "num_gpus_per_worker": 1 if on_gpu else 0,
        "engine": {
            "scheduling_policy": pool.scheduling_policy,
            "max_num_batched_tokens": pool.max_num_batched_tokens,
            "kv_cache_memory_bytes": int(kv_bytes),
        },
    }


def _add_threads(plan: dict, candidate) -> None:
    """A CPU profile holds at the threads it was measured with: one figure for every worker, or,
    when the pools' hardware differ in it, each pool's instances their own."""
    threads = {role: threads_per_rank(pool.hardware) for role, pool in candidate.pools.items()}
    measured = {t for t in threads.values() if t is not None}
    if len(measured) == 1:
        plan["threads_per_worker"] = measured.pop()
        return
    for role, t in threads.items():
        if t is not None:
            # one dict each: YAML would write a shared one as an anchor and aliases
            plan[role]["instances"] = [{"threads_per_worker": t} for _ in range(candidate.pools[role].instances)]


def is_mixed(kinds) -> bool:
    """The cluster has nodes of more than one hardware kind."""
    return len({kind.hardware.name for kind in kinds}) > 1


def hardware_label(hardware: str) -> str:
    """The custom Ray resource that marks a node of this hardware (its catalogue name)."""
    return hardware


def hardware_label_comment(candidate, kinds) -> str:
    """YAML header lines telling the operator which label each node kind needs ("" on one kind)."""
    if not is_mixed(kinds):
        return ""
    lines = ["# Mixed hardware: each pool runs on its node kind, pinned by a custom Ray resource named after it."]
    for hardware in sorted({pool.hardware for pool in candidate.pools.values()}):
        roles = " and ".join(role for role, pool in candidate.pools.items() if pool.hardware == hardware)
        label = json.dumps({hardware_label(hardware): 1})
        lines.append(f"#   every {hardware} node ({roles}): ray start ... --resources='{label}'")
    lines += [
        "# With `disagg serve --cluster` a node also carries its pool's label, both in one --resources",
        '# (e.g. \'{"prefill": 1, "a100-80gb": 1}\'; deploy/cluster-aws.yaml: the node type\'s resources).',
        "# disagg serve waits until a node with each label has joined (docs/deploy.md: With `ray up`).",
    ]
    return "\n".join(lines) + "\n"
