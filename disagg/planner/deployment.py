"""A deployment as the simulator runs it: a serving config, the profile of each pool's hardware,
and the KV capacity each instance gets.

The KV capacity follows the config (`engine.num_kv_blocks`, else `kv_cache_memory_bytes` per
worker, as the engine sizes its cache), unless the config leaves memory to the hardware
(`from_hardware=True`, the planner's GPU candidates and replayed traces): then it is what is left
of each device's memory after its share of the weights (`disagg.planner.memory`).

A replayed trace of another system (`system`, disagg.planner.traced_systems) runs as that system
does: its engine settings, its memory rule and its decode admission. A profile's `frontend_ms`
(a published one's, fitted) is each request's time before its prefill. A config that starts its
own Ray puts every instance on this machine, where they share its cores (the profile's
`host_sharing`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from disagg.config import PoolConfig, ServingConfig
from disagg.placement.factory import placement_policy
from disagg.placement.policies import PlacementPolicy
from disagg.placement.profile import Profile
from disagg.planner import memory
from disagg.planner.hardware import known_hardware
from disagg.planner.models import known_models, kv_bytes_per_token, model_spec
from disagg.planner.simulator import SimPool, Simulator, pools_from_config
from disagg.planner.traced_systems import TracedSystem, system_of

DEFAULT_MAX_MODEL_LEN = 8192
# Those systems queue every request: no frontend limit like ours, no SLO admission, and no giving
# up on a request that waits for room.
TRACE_INFLIGHT_LIMIT = 2**31
TRACE_PLACEMENT = "least_work"
TRACE_ADMISSION_TIMEOUT_S = 1e9


@dataclass
class Deployment:
    config: ServingConfig
    profiles: dict[str, Profile]  # per role ("prefill", "decode", "colocated"); one may serve all
    from_hardware: bool = False
    router_overhead_ms: float = 0.0
    policy: PlacementPolicy | None = None  # None: the one the config names, as `disagg serve` runs it
    system: TracedSystem | None = None  # another system whose trace is replayed (None: ours)

    def pools(self) -> list[SimPool]:
        config = self.config if not self.from_hardware else self._sized_by_hardware()
        profile = self.any_profile
        return pools_from_config(
            config,
            lambda role, tp, pp: self.profiles[role].step_model(tp, pp),
            profile.kv_bytes_per_token or self._kv_bytes_per_token(),
            self._max_model_len(),
            self._sliding_window(),
        )

    def simulator(self, on_arrive=None) -> Simulator:
        """`on_arrive`: told of each request as it arrives (Simulator.on_arrive)."""
        profile = self.any_profile
        return Simulator(
            self.pools(),
            policy=self.policy if self.policy is not None else placement_policy(self.config),
            transfer=self.profiles.get("prefill", profile).kv_transfer,
            kv_bytes_per_token=profile.kv_bytes_per_token or self._kv_bytes_per_token(),
            num_layers=profile.num_layers,
            router_overhead_ms=self.router_overhead_ms + self.profiles.get("prefill", profile).frontend_ms,
            admission_timeout_s=TRACE_ADMISSION_TIMEOUT_S if self.system else self.config.admission_timeout_s,
            decode_admission=self.system.decode_admission if self.system else "retry",
            max_inflight=self.config.inflight_limit(),
            slo=self.config.slo,
            host_sharing=self._host_sharing(),
            on_arrive=on_arrive,
        )

    def _host_sharing(self):
        """A config that starts its own Ray runs every instance on this machine: they share its
        cores as the profile measured (a replayed trace ran on separate GPUs: nothing shared)."""
        if self.system is not None or self.config.ray_address is not None:
            return None
        return self.any_profile.host_sharing

    @property
    def any_profile(self) -> Profile:
        return next(iter(self.profiles.values()))

    # ---- memory ------------------------------------------------------------------------------------
    def _sized_by_hardware(self) -> ServingConfig:
        pools = {}
        for role, pool in self.config.pools():
            profile = self.profiles[role]
            tokens = memory.kv_capacity_tokens(
                _model(profile), _hardware(profile), *_shape(pool), **self._memory_rule()
            )
            blocks = max(1, tokens // self.config.engine.block_size)
            pools[role] = _with_engine(pool, num_kv_blocks=blocks)
        return _replace_pools(self.config, pools)

    def _memory_rule(self) -> dict:
        if self.system is None:
            return {}
        return {"utilization": self.system.memory_utilization, "activation_tokens": self.system.activation_tokens}

    def _kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(_model(self.any_profile))

    def _sliding_window(self) -> int | None:
        """The model's window every layer shares, where its shape is known (None otherwise)."""
        try:
            return _model(self.any_profile).shared_window
        except ValueError:  # a profile of a model the catalogue does not list
            return None

    def _max_model_len(self) -> int:
        name = self.any_profile.model
        known = name in known_models() or name.split("/")[-1] in known_models()
        return model_spec(name).max_position_embeddings if known else DEFAULT_MAX_MODEL_LEN


def trace_config(trace_config: dict, model: str) -> ServingConfig:
    """The serving config a trace recorded ({"mode", "prefill": {"tp", "pp", "instances"}, ...})."""
    mode = trace_config.get("mode", "disaggregated")
    engine = {"model": model, **system_of(trace_config).engine}

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


def trace_deployment(recorded: dict, model: str, profile: Profile) -> Deployment:
    """A trace's own deployment (its recorded config), run as the system that recorded it, its KV
    sized by its hardware."""
    config = trace_config(recorded, model)
    profiles = {role: profile for role, _ in config.pools()}
    return Deployment(config, profiles, from_hardware=True, system=system_of(recorded))


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


def with_split(config: ServingConfig, num_prefill: int, num_decode: int) -> ServingConfig:
    """A disaggregated config with these many prefill and decode instances (the re-planner's candidates)."""
    if config.mode != "disaggregated":
        raise ValueError("a prefill:decode split needs a disaggregated config")
    pools = {
        "prefill": replace(config.prefill, num_instances=num_prefill),
        "decode": replace(config.decode, num_instances=num_decode),
    }
    return _replace_pools(config, pools)


def _shape(pool: PoolConfig) -> tuple[int, int]:
    return pool.tensor_parallel_size, pool.pipeline_parallel_size


def _with_engine(pool: PoolConfig, **engine) -> PoolConfig:
    return replace(pool, engine={**pool.engine, **engine})


def _replace_pools(config: ServingConfig, pools: dict[str, PoolConfig]) -> ServingConfig:
    return replace(config, **pools)
