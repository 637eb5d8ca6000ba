"""Which CPUs the engine threads get, on the machine whose Ray `disagg serve` starts.

Ray, Redis, gRPC, gloo and the workers' link, KV and heartbeat threads wake up hundreds of times
a second; Linux wakes such a thread on the CPU where its timer fired, often the one a busy engine
thread computes on, and the wake-up preempts the engine. So, as vLLM's CPU backend binds its
compute threads, engine threads get CPUs of their own and every other thread of the deployment
is kept off them.

Prefill engines come first (what delays a prefill delays the first token), then colocated, then
decode engines, `threads_per_worker` CPUs each, while enough CPUs are left for everything else:
two with `cpu_binding: auto`, one with `on`. With one left, the first token's way out and the
decode side's start of the request meet on that CPU, which cost more than binding gained on 2
CPUs (loadtest/RESULTS.md). An engine that gets no CPU of its own runs on any CPU. Engines take
the highest-numbered CPUs, since interrupts and kernel housekeeping favour CPU 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from disagg.config import ServingConfig

DEDICATION_ORDER = ("prefill", "colocated", "decode")
CPUS_LEFT_FOR_THE_REST = {"auto": 2, "on": 1}  # by cpu_binding


@dataclass(frozen=True)
class CpuPlan:
    framework: frozenset[int]  # Ray, Redis, the frontend, and each worker's threads but its engine's
    engines: dict[tuple[str, int], frozenset[int]]  # (pool, instance index) -> its engine thread's own CPUs

    @property
    def all_cpus(self) -> frozenset[int]:
        return self.framework.union(*self.engines.values())

    def engine_cpus(self, role: str, index: int) -> frozenset[int]:
        return self.engines.get((role, index), self.all_cpus)

    def describe(self) -> str:
        engines = ", ".join(f"{role}-{index} on {sorted(cpus)}" for (role, index), cpus in self.engines.items())
        return f"engine threads: {engines}; other engines on any CPU; everything else on {sorted(self.framework)}"


def plan_cpus(config: ServingConfig, cpus: Iterable[int]) -> CpuPlan | None:
    """None when binding is off or no engine can have a CPU of its own."""
    if config.cpu_binding == "off":
        return None
    free = sorted(set(cpus))
    left = CPUS_LEFT_FOR_THE_REST[config.cpu_binding]
    engines = {}
    for role, pool in sorted(config.pools(), key=lambda rp: DEDICATION_ORDER.index(rp[0])):
        if pool.workers_per_instance != 1:
            continue  # the other ranks of a TP x PP instance compute on Ray's threads, which we do not bind
        for index in range(pool.num_instances):
            per_engine = config.worker_threads(pool, index)
            if len(free) - per_engine < left:
                break
            engines[(role, index)] = frozenset(free[-per_engine:])
            del free[-per_engine:]
    return CpuPlan(frozenset(free), engines) if engines else None


def bind_this_thread(cpus: Iterable[int]) -> None:
    """Threads and processes this thread starts afterwards inherit the set."""
    os.sched_setaffinity(0, set(cpus))


def bind_all_threads(cpus: Iterable[int]) -> dict[int, set[int]]:
    """Every thread of this process on `cpus` (those started before, by imports or the CLI,
    included: threads they start later inherit it). Returns each thread's CPUs before."""
    before = {}
    for name in os.listdir("/proc/self/task"):
        thread_id = int(name)
        try:
            before[thread_id] = os.sched_getaffinity(thread_id)
            os.sched_setaffinity(thread_id, set(cpus))
        except OSError:
            pass  # it ended meanwhile
    return before


def restore_threads(before: dict[int, set[int]]) -> None:
    for thread_id, cpus in before.items():
        try:
            os.sched_setaffinity(thread_id, cpus)
        except OSError:
            pass  # it ended meanwhile


def keep_off_engine_cpus(engine_thread_id: int, framework: set[int]) -> int:
    """Moves this process's threads but the engine's back to the framework's CPUs: those the
    engine thread started (a KV channel's, gloo's for a new peer) inherited its CPUs, and we do
    not create all of them ourselves. Returns how many moved."""
    moved = 0
    for name in os.listdir("/proc/self/task"):
        thread_id = int(name)
        try:
            if thread_id != engine_thread_id and os.sched_getaffinity(thread_id) != framework:
                os.sched_setaffinity(thread_id, framework)
                moved += 1
        except OSError:
            pass  # it ended meanwhile
    return moved
