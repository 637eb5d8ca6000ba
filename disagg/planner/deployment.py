"""A deployment as the simulator runs it: a serving config, the profile of each pool's hardware,
and the KV capacity each instance gets.

The KV capacity follows the config (`engine.num_kv_blocks`, else `kv_cache_memory_bytes` per
worker, as the engine sizes its cache), unless the config leaves memory to the hardware
(`from_hardware=True`, the planner's GPU candidates and replayed traces): then it is what is left
of each device's memory after its share of the weights (`disagg.planner.memory`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from disagg.config import PoolConfig, ServingConfig
from disagg.placement.factory import placement_policy
from disagg.placement.policies import PlacementPolicy, Slo
from disagg.placement.profile import Profile
from disagg.planner import memory
from disagg.planner.hardware import known_hardware
from disagg.planner.models import known_models, kv_bytes_per_token, model_spec
from disagg.planner.simulator import SimPool, Simulator, pools_from_config

DEFAULT_MAX_MODEL_LEN = 8192
# Engine settings of the systems whose measured runs a trace may come from (DistServe's README).
TRACE_SYSTEMS = {
    # DistServe: the prefill instance batches whole prompts; the decode instance batches every request it holds.
    "distserve": {"scheduling_policy": "prefill_first", "max_num_batched_tokens": 16384, "max_num_seqs": 1024},
    # vLLM 0.2: whole prompts first, decodes stall; its default budget and batch size.
    "vllm": {"scheduling_policy": "prefill_first", "max_num_batched_tokens": 2560, "max_num_seqs": 256},
}
# Those systems queue every request: no frontend limit like ours, and no SLO admission.
TRACE_INFLIGHT_LIMIT = 2**31
TRACE_PLACEMENT = "least_work"


@dataclass
class Deployment:
    config: ServingConfig
    profiles: dict[str, Profile]  # per role ("prefill", "decode", "colocated"); one may serve all
    from_hardware: bool = False
    router_overhead_ms: float = 0.0
    policy: PlacementPolicy | None = None  # None: the one the config names, as `disagg serve` runs it

    def pools(self) -> list[SimPool]:
        config = self.config if not self.from_hardware else self._sized_by_hardware()
        profile = self.any_profile
        return pools_from_config(
            config,
            lambda role, tp, pp: self.profiles[role].step_model(tp, pp),
            profile.kv_bytes_per_token or self._kv_bytes_per_token(),
            self._max_model_len(),
        )

    def simulator(self) -> Simulator:
        profile = self.any_profile
        return Simulator(
            self.pools(),
            policy=self.policy if self.policy is not None else placement_policy(self.config),
            transfer=self.profiles.get("prefill", profile).kv_transfer,
            kv_bytes_per_token=profile.kv_bytes_per_token or self._kv_bytes_per_token(),
            num_layers=profile.num_layers,
            router_overhead_ms=self.router_overhead_ms,
            admission_timeout_s=self.config.admission_timeout_s,
            max_inflight=self.config.inflight_limit(),
            slo=Slo(self.config.slo.ttft_ms, self.config.slo.tpot_ms),
        )

    @property
    def any_profile(self) -> Profile:
        return next(iter(self.profiles.values()))

    # ---- memory ------------------------------------------------------------------------------------
    def _sized_by_hardware(self) -> ServingConfig:
        pools = {}
        for role, pool in self.config.pools():
            profile = self.profiles[role]
            tokens = memory.kv_capacity_tokens(_model(profile), _hardware(profile), *_shape(pool))
            blocks = max(1, tokens // self.config.engine.block_size)
            pools[role] = _with_engine(pool, num_kv_blocks=blocks)
        return _replace_pools(self.config, pools)

    def _kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(_model(self.any_profile))

    def _max_model_len(self) -> int:
        name = self.any_profile.model
        known = name in known_models() or name.split("/")[-1] in known_models()
        return model_spec(name).max_position_embeddings if known else DEFAULT_MAX_MODEL_LEN


def trace_config(trace_config: dict, model: str) -> ServingConfig:
    """The serving config a trace recorded ({"mode", "prefill": {"tp", "pp", "instances"}, ...})."""
    mode = trace_config.get("mode", "disaggregated")
    system = "vllm" if "vllm" in str(trace_config.get("scheduler", "")) else "distserve"
    engine = {"model": model, **TRACE_SYSTEMS[system]}

    def pool(entry: dict) -> dict:
        return {
            "num_instances": int(entry.get("instances", 1)),
            "tensor_parallel_size": int(entry.get("tp", 1)),
            "pipeline_parallel_size": int(entry.get("pp", 1)),
        }

    common = {"engine": engine, "max_inflight_requests": TRACE_INFLIGHT_LIMIT, "placement": TRACE_PLACEMENT}
    if mode == "colocated":
        return ServingConfig.from_dict({"mode": "colocated", **common, "colocated": pool(trace_config)})
    pools = {"prefill": pool(trace_config.get("prefill", {})), "decode": pool(trace_config.get("decode", {}))}
    return ServingConfig.from_dict({"mode": "disaggregated", **common, **pools})


def _model(profile: Profile):
    return model_spec(profile.model)


def _hardware(profile: Profile):
    hardware = known_hardware().get(profile.hardware)
    if hardware is None:
        raise ValueError(
            f"profile hardware {profile.hardware!r} is not in the catalogue ({', '.join(known_hardware())}): "
            "give the config's engine.num_kv_blocks"
        )
    return hardware


def _shape(pool: PoolConfig) -> tuple[int, int]:
    return pool.tensor_parallel_size, pool.pipeline_parallel_size


def _with_engine(pool: PoolConfig, **engine) -> PoolConfig:
    return replace(pool, engine={**pool.engine, **engine})


def _replace_pools(config: ServingConfig, pools: dict[str, PoolConfig]) -> ServingConfig:
    return replace(config, **pools)
