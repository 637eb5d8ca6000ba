"""A search's best candidate as a serving config (the YAML `disagg serve --config` reads)."""

from __future__ import annotations

from disagg.planner.hardware import threads_per_rank
from disagg.planner.memory import kv_bytes_per_token_per_device
from disagg.planner.models import model_spec

BLOCK_SIZE = 16


def serving_config_dict(candidate, model: str, slo_ms: dict, kinds) -> dict:
    """Mode, model, each pool's shape, instance count, devices, scheduler and KV memory, and the SLO."""
    config = model_spec(model)
    plan = {"mode": candidate.mode, "engine": {"model": model, "block_size": BLOCK_SIZE}}
    for role, pool in candidate.pools.items():
        on_gpu = not pool.hardware.startswith("cpu")
        dtype_bytes = 2 if on_gpu else 4  # bfloat16 on GPU, float32 on CPU (the engine's "auto")
        kv_bytes = (
            pool.num_kv_blocks * BLOCK_SIZE * kv_bytes_per_token_per_device(config, pool.tp, pool.pp, dtype_bytes)
        )
        plan[role] = {
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
        threads = threads_per_rank(pool.hardware)
        if threads is not None:  # a CPU profile holds at the threads it was measured with
            plan["threads_per_worker"] = threads
    plan["slo"] = {"ttft_ms": slo_ms["ttft_ms"], "tpot_ms": slo_ms["tpot_ms"]}
    return plan
