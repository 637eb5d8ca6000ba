"""A worker changes pools without reloading its weights: prefill <-> decode (issue 36).

The instance first leaves placement and ends or moves away what it holds (a drain: decode
requests move with their KV, disagg.router.live_moves; prefills finish). Then the same engine,
weights and KV memory untouched, gets its new role state: a scheduler and block table for the
role, and the role's KV endpoint over a new transport (a sender for PREFILL; a receiver, and a
sender for moving requests out, for DECODE). The new worker is built completely before the old
one is closed, so a switch that fails leaves the old worker serving as before; only then does
the instance register in its new pool.
"""

from __future__ import annotations

from disagg.config import Role
from disagg.decode_worker.worker import DecodeWorker
from disagg.kv_transfer.transport import Transport
from disagg.prefill_worker.worker import PrefillWorker

Worker = PrefillWorker | DecodeWorker


def switch_worker(
    worker: Worker,
    role: Role,
    transport: Transport,
    *,
    kv_timeout: float,
    migration_transport: Transport | None = None,
) -> Worker:
    """`worker`'s engine as a worker of `role`, its KV moving over `transport` (and, for DECODE,
    moves out over `migration_transport`). The old worker must be idle; it is closed once the
    new one exists. ValueError (the old worker untouched) when it cannot switch."""
    if role not in (Role.PREFILL, Role.DECODE):
        raise ValueError(f"switch: to {role}? only the prefill and decode roles switch")
    if not worker.is_idle():
        raise ValueError("switch: the worker still holds requests; drain it first")
    engine = worker.engine
    if role is Role.PREFILL:
        new = PrefillWorker(engine.config, transport, kv_timeout=kv_timeout, engine=engine)
    else:
        new = DecodeWorker(
            engine.config, transport, kv_timeout=kv_timeout, migration_transport=migration_transport, engine=engine
        )
    worker.close()
    return new
