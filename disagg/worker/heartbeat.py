"""A worker's heartbeat to the registry: what it is and how loaded, every interval, under a key
that lapses unless refreshed (the etcd-lease pattern, DESIGN.md "Redis")."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from disagg.engine.engine import LLMEngine
from disagg.errors import RegistryUnavailable
from disagg.registry import InstanceInfo, LoadReport, Registry

logger = logging.getLogger(__name__)
MAX_REPORTED_STEPS = 128  # per heartbeat: bounds what one report weighs in Redis
MAX_PREFIX_HASHES = 4096  # likewise (about 80 kB of JSON at most)
MAX_REPORTED_DECODES = 512  # likewise (a pair of numbers each)

Report = Callable[[], tuple[InstanceInfo, LoadReport]]


class Heartbeat:
    def __init__(
        self,
        registry_url: str | None,
        interval_s: float,
        ttl_s: float,
        report: Report,
        before_beat: Callable[[], None] = lambda: None,
    ):
        """`report`: what each beat registers (read on the heartbeat's thread); `before_beat`:
        run first each time (the worker keeps threads off its engine's CPUs there). No
        `registry_url`: no heartbeat at all (a worker outside a deployment)."""
        self.registry_url = registry_url
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._report = report
        self._before_beat = before_beat
        self._enabled = threading.Event()
        self._enabled.set()
        self._lock = threading.Lock()  # a beat and a deregistration never interleave
        self._stopping = threading.Event()
        self._now = threading.Event()  # beat at once, not at the interval's end

    def start(self, name: str) -> None:
        if self.registry_url:
            threading.Thread(target=self._run, name=f"heartbeat-{name}", daemon=True).start()

    def beat_now(self) -> None:
        """The next beat at once: a change the routers must see soon (a drain) does not wait for
        the interval's end."""
        self._now.set()

    def set_enabled(self, enabled: bool) -> None:
        (self._enabled.set if enabled else self._enabled.clear)()

    def leave(self, instance_id: str, coming_back: bool = False) -> None:
        """No more beats, and out of the registry now (a beat under way would re-register it)."""
        with self._lock:
            self._enabled.clear()
            self.deregister(instance_id, coming_back)

    def stop(self, instance_id: str) -> None:
        self._stopping.set()
        self._now.set()
        self.deregister(instance_id)

    def deregister(self, instance_id: str, coming_back: bool = False) -> None:
        if not self.registry_url:
            return
        try:
            registry = Registry(self.registry_url)
            registry.deregister(instance_id, coming_back)
            registry.close()
        except RegistryUnavailable:
            pass

    def _run(self) -> None:
        registry = Registry(self.registry_url)
        while True:
            self._now.wait(self.interval_s)
            self._now.clear()
            if self._stopping.is_set():
                break
            self._before_beat()
            with self._lock:
                if not self._enabled.is_set():
                    continue
                info, load = self._report()
                try:
                    registry.heartbeat(info, load, self.ttl_s)
                except RegistryUnavailable as exc:  # keep serving; the next beat retries
                    logger.warning("heartbeat failed: %s", exc)
        registry.close()


def engine_load(engine: LLMEngine) -> LoadReport:
    """A snapshot readable from any thread (len() of the scheduler's queues is atomic), with the
    engine's latest steps and the prefix blocks it holds."""
    scheduler = engine.scheduler
    queued = sum(
        r.num_tokens - r.num_computed_tokens
        for r in list(scheduler.waiting) + list(scheduler.running)
        if r.num_computed_tokens < r.num_prompt_tokens
    )
    free, total = engine.num_free_blocks, engine.num_total_blocks
    context = sum(r.num_tokens for r in list(scheduler.running))
    return LoadReport(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting) + len(scheduler.suspended),  # suspended: waiting for a slot again
        num_waiting_for_kv=len(scheduler.waiting_for_kv),
        queued_prefill_tokens=queued,
        num_free_blocks=free,
        num_total_blocks=total,
        kv_cache_usage=1.0 - free / total,
        updated_at=time.time(),
        decode_context_tokens=context,
        decodes=running_decodes(scheduler.running),
        expert_tokens=engine.expert_tokens(),
    )


def running_decodes(running) -> list[list[int]]:
    """[context, output tokens left] of each request past its prompt: left by its predicted
    length where the router gave one, else by its max_tokens."""
    decodes = []
    for r in list(running)[:MAX_REPORTED_DECODES]:
        if r.num_computed_tokens < r.num_prompt_tokens:
            continue
        expected = r.sampling_params.max_tokens
        if r.predicted_output_len is not None:
            expected = min(expected, r.predicted_output_len)
        decodes.append([r.num_tokens, max(1, expected - r.num_output_tokens)])
    return decodes


def recent_steps(engine: LLMEngine) -> list[list]:
    """The engine's latest steps, each a `MeasuredStep.to_list()`: every report repeats the last
    MAX_REPORTED_STEPS, so a router that reads Redis less often than workers beat misses none (it
    learns each index once)."""
    try:
        latest = list(engine.step_stats)[-MAX_REPORTED_STEPS:]
    except RuntimeError:  # appended to while copied: the next beat has them
        return []
    return [step.to_list() for step in latest]
