"""Engine + KV endpoint, assembled in one place for every rank of every role.

Rank 0 of an instance (the roles: disagg.prefill_worker, disagg.decode_worker) and the other
ranks (disagg.worker.shard) build the same thing: a transport, the KV endpoint of the role (a sender
for PREFILL, a receiver for DECODE, none for COLOCATED) and the engine with it as its KV
connector. Each rank moves its own slice of the KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from disagg.config import EngineConfig, Role
from disagg.engine.distributed import InstanceGroups
from disagg.engine.engine import LLMEngine
from disagg.engine.kv_connector import Followers
from disagg.kv_transfer.endpoint import KVEndpoint
from disagg.kv_transfer.layout import KVLayout, KVRank
from disagg.kv_transfer.receiver import KVReceiver
from disagg.kv_transfer.sender import KVSender
from disagg.kv_transfer.transport import Transport


@dataclass
class EngineWithKV:
    engine: LLMEngine
    endpoint: KVSender | KVReceiver | None  # None: a colocated instance moves no KV


def assemble(
    config: EngineConfig,
    role: Role,
    *,
    kv_timeout: float,
    transport: Transport | None = None,
    groups: InstanceGroups | None = None,
    followers: Followers | None = None,
    engine: LLMEngine | None = None,
    wake: Callable[[], None] | None = None,
) -> EngineWithKV:
    """The engine of `role` with its KV endpoint, which talks over `transport` (None only for a
    colocated instance, which moves no KV). `groups`: this rank's
    process groups in a TP x PP instance; `followers`: rank 0's handle on the other ranks.
    `engine`: an idle engine of this process to switch to `role` instead of loading one (its
    weights stay: a role switch, disagg.worker.actor). `wake`: the endpoint's (KVEndpoint): what
    makes the loop that polls it poll now."""
    endpoint = None
    if role is not Role.COLOCATED:
        if transport is None:
            raise ValueError(f"transport: a {role} engine moves KV and needs one")
        if role is Role.PREFILL:
            endpoint = KVSender(transport, timeout=kv_timeout, wake=wake)
        else:
            endpoint = KVReceiver(transport, timeout=kv_timeout, attention_backend=config.attention_backend, wake=wake)
    if engine is not None:
        engine.switch_role(role, endpoint)
        return EngineWithKV(engine, endpoint)
    engine = LLMEngine(config.replace(role=role), groups=groups, kv_connector=endpoint, followers=followers)
    return EngineWithKV(engine, endpoint)


def instance_kv_layout(config: EngineConfig, rank0: KVEndpoint | None, other_ranks: list[KVRank]) -> KVLayout | None:
    """Every rank's KV endpoint, rank 0 first (None for a colocated instance, which moves no KV)."""
    if rank0 is None:
        return None
    p = config.parallel
    return KVLayout(
        p.tensor_parallel_size, p.pipeline_parallel_size, (KVRank(rank0.worker_id, rank0.address()), *other_ranks)
    )
