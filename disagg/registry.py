"""Redis soft state shared by the workers and the router: instance registry, load, request records.

Each instance owns one key, `<ns>:instance:<id>`, written with `SET ... EX ttl` by every heartbeat
(the etcd-lease pattern): an instance whose heartbeats stop disappears after `ttl`, one that comes
back simply re-appears. Nothing here is the only copy of anything; losing Redis loses no request.
Every Redis failure surfaces as `RegistryUnavailable`; the caller decides (a worker keeps serving
and heartbeats again later, the router keeps its last view).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Iterator
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from disagg.errors import RegistryUnavailable

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")


@dataclass
class InstanceInfo:
    """What a worker publishes about itself (changes only when the worker restarts)."""

    instance_id: str
    role: str  # "prefill" | "decode" | "colocated"
    actor_name: str
    kv_address: str
    model: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    started_at: float = 0.0
    kv_ranks: list = field(
        default_factory=list
    )  # [peer id, address, tp rank, pp rank] of every rank (KVLayout.to_list)
    rpc_address: str = ""  # host:port of the request link (disagg.rpc) on rank 0
    expert_parallel_size: int = 1  # the ranks a mixture of experts' experts are split over


@dataclass
class LoadReport:
    """A worker's load at its last heartbeat."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_for_kv: int = 0
    queued_prefill_tokens: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0
    updated_at: float = 0.0
    decode_context_tokens: int = 0  # the running requests' contexts, summed
    # Its running decodes (at most MAX_REPORTED_DECODES), each [context tokens, output tokens it
    # is expected to write still]: the live state the re-planner prices from.
    decodes: list = field(default_factory=list)
    # The engine's latest steps, each [step index, ms, decodes, decode context sum, then each prompt
    # chunk's start and tokens] (disagg.step_work.MeasuredStep): what the router's model learns from.
    steps: list = field(default_factory=list)
    # Chained hashes of its cached KV blocks (the newest, at most MAX_PREFIX_HASHES): where a
    # prompt's prefix is warm (disagg.engine.block_manager.chain_hash).
    prefix_hashes: list = field(default_factory=list)
    # Leaving (SIGTERM, scale-in): no new requests, and routers move its requests elsewhere with
    # their KV (disagg.router.live_moves) before it goes.
    draining: bool = False
    # Its KV pairs so far: peer worker id -> how KV goes to it (kv_transfer.paths: `disagg status`).
    kv_paths: dict = field(default_factory=dict)
    # A mixture of experts: tokens routed to each expert since the start, over rank 0's MoE
    # layers ([] for a dense model): `disagg:moe_expert_tokens_total`.
    expert_tokens: list = field(default_factory=list)
    # KV tiers under the pool (disagg.engine.kv_tiers, TierStats.to_dict): hits and bytes by
    # tier, what each holds, and its publisher's index state ({} without tiers).
    kv_tiers: dict = field(default_factory=dict)


@dataclass
class InstanceView:
    """What the router reads about one live instance."""

    info: InstanceInfo
    load: LoadReport
    heartbeat_age_s: float


def _from_dict(cls, data: dict[str, Any]):
    # Unknown keys are dropped so that a newer worker's extra fields don't break an older router.
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


def redact_url(url: str) -> str:
    """The URL with any password replaced by `***` (safe for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redis_client(url: str, timeout_s: float) -> redis.Redis:
    """A client with short socket timeouts and one immediate retry, which covers a pooled
    connection that went stale (Redis restarted); beyond that the caller retries on its own
    schedule. Nothing is retried forever."""
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
        decode_responses=True,
    )


class Registry:
    """One Redis client with short socket timeouts; keys live under `<namespace>:`."""

    def __init__(
        self,
        url: str,
        namespace: str = "disagg",
        timeout_s: float = 1.0,
        max_request_records: int = 1000,
    ):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_request_records < 1:
            raise ValueError(f"max_request_records must be >= 1, got {max_request_records}")
        self.namespace = namespace
        self.max_request_records = max_request_records
        self._safe_url = redact_url(url)
        self._client = redis_client(url, timeout_s)

    # -- keys -------------------------------------------------------------------------------

    def _instance_key(self, instance_id: str) -> str:
        return f"{self.namespace}:instance:{instance_id}"

    def _requests_key(self) -> str:
        return f"{self.namespace}:requests"

    def _arrivals_key(self) -> str:
        return f"{self.namespace}:arrivals"

    def _verdicts_key(self) -> str:
        return f"{self.namespace}:slo_verdicts"

    @contextlib.contextmanager
    def _redis_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as exc:
            raise RegistryUnavailable(
                f"registry {what} failed: Redis at {self._safe_url}: {type(exc).__name__}: {exc}"
            ) from exc

    # -- instances ----------------------------------------------------------------------------

    def heartbeat(self, info: InstanceInfo, load: LoadReport, ttl_s: float) -> None:
        """Publish (or refresh) this instance's key; it expires unless refreshed within `ttl_s`."""
        if info.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {info.role!r}")
        ttl_ms = int(ttl_s * 1000)
        if ttl_ms < 1:
            raise ValueError(f"ttl_s must be at least 0.001, got {ttl_s}")
        value = json.dumps({"info": asdict(info), "load": asdict(load), "ttl_ms": ttl_ms})
        with self._redis_errors("heartbeat"):
            pipe = self._client.pipeline(transaction=False)
            pipe.set(self._instance_key(info.instance_id), value, px=ttl_ms)
            pipe.delete(self._left_key(info.instance_id))  # back after leaving: no longer departed
            pipe.execute()

    def _left_key(self, instance_id: str) -> str:
        return f"{self.namespace}:left:{instance_id}"

    def deregister(self, instance_id: str, coming_back: bool = False, remember_s: float = 600.0) -> None:
        """The key goes. Unless the instance is `coming_back` (relaunched), a note that it left
        stays for `remember_s`, so that routers tell a departure (nothing to wait for) from a
        lapsed heartbeat or a relaunch (worth waiting for)."""
        with self._redis_errors("deregister"):
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self._instance_key(instance_id))
            if not coming_back:
                pipe.set(self._left_key(instance_id), "1", px=int(remember_s * 1000))
            pipe.execute()

    def departed(self, instance_ids: Iterable[str]) -> set[str]:
        """Those of `instance_ids` that deregistered (within the note's lifetime) and have not
        registered again since."""
        ids = list(instance_ids)
        if not ids:
            return set()
        with self._redis_errors("departed"):
            notes = self._client.mget([self._left_key(i) for i in ids])
        return {i for i, note in zip(ids, notes) if note is not None}

    def instances(self, role: str | None = None) -> list[InstanceView]:
        """Live instances (optionally of one role), sorted by id."""
        with self._redis_errors("instances"):
            keys = list(self._client.scan_iter(match=self._instance_key("*"), count=500))
            if not keys:
                return []
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
                pipe.pttl(key)
            replies = pipe.execute()
        views = []
        for key, value, pttl_ms in zip(keys, replies[0::2], replies[1::2]):
            view = self._decode_instance(key, value, pttl_ms)
            if view is not None and (role is None or view.info.role == role):
                views.append(view)
        return sorted(views, key=lambda v: v.info.instance_id)

    @staticmethod
    def _decode_instance(key: str, value: str | None, pttl_ms: int) -> InstanceView | None:
        if value is None:  # expired or deregistered between SCAN and GET
            return None
        try:
            data = json.loads(value)
            info = _from_dict(InstanceInfo, data["info"])
            load = _from_dict(LoadReport, data["load"])
            ttl_ms = int(data["ttl_ms"])
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("skipping malformed registry entry %s: %s", key, exc)
            return None
        # Age from Redis's own countdown, not our clock: immune to clock skew between machines.
        age_s = max(0.0, (ttl_ms - max(pttl_ms, 0)) / 1000.0)
        return InstanceView(info=info, load=load, heartbeat_age_s=age_s)

    # -- request records ------------------------------------------------------------------------

    def record_request(self, record: dict, ttl_s: float = 3600) -> None:
        """Append a finished request's record; the newest `max_request_records` are kept for `ttl_s`."""
        self.record_requests([record], ttl_s)

    def record_requests(self, records: list[dict], ttl_s: float = 3600) -> None:
        """Append several records (oldest first) in one round trip."""
        ttl_ms = int(ttl_s * 1000)
        if ttl_ms < 1:
            raise ValueError(f"ttl_s must be at least 0.001, got {ttl_s}")
        if not records:
            return
        key = self._requests_key()
        with self._redis_errors("record_requests"):
            pipe = self._client.pipeline(transaction=True)
            pipe.lpush(key, *(json.dumps(r) for r in records))
            pipe.ltrim(key, 0, self.max_request_records - 1)
            pipe.pexpire(key, ttl_ms)
            pipe.execute()

    def recent_requests(self, limit: int = 100) -> list[dict]:
        """Up to `limit` records, newest first."""
        if limit <= 0:
            return []
        with self._redis_errors("recent_requests"):
            values = self._client.lrange(self._requests_key(), 0, limit - 1)
        return [json.loads(v) for v in values]

    # -- arrivals (frontends -> the re-planner in the controller) ------------------------------

    def push_arrivals(self, arrivals: list[tuple], keep: int, ttl_s: float) -> None:
        """Append (wall-clock time, prompt tokens, output tokens asked for, TTFT target ms, TPOT
        target ms, priority) of requests that arrived (targets None: the server's SLO); the
        newest `keep` are kept, none longer than `ttl_s` unread."""
        self._push_unread(self._arrivals_key(), [_arrival_text(*a) for a in arrivals], keep, ttl_s)

    def take_arrivals(self) -> list[tuple]:
        """Every arrival pushed and not yet taken, oldest first, as pushed; taken ones are gone."""
        return [_arrival_of(value) for value in self._take_unread(self._arrivals_key())]

    def push_verdicts(self, verdicts: list[tuple[float, bool]], keep: int, ttl_s: float) -> None:
        """Append (wall-clock time, met) of requests judged against their SLO (frontends -> the
        re-planner, which checks its last decision on every frontend's requests)."""
        self._push_unread(self._verdicts_key(), [f"{t:.6f},{int(met)}" for t, met in verdicts], keep, ttl_s)

    def take_verdicts(self) -> list[tuple[float, bool]]:
        """Every verdict pushed and not yet taken, oldest first; taken ones are gone."""
        verdicts = []
        for value in self._take_unread(self._verdicts_key()):
            t, met = value.split(",")
            verdicts.append((float(t), met == "1"))
        return verdicts

    def _push_unread(self, key: str, values: list[str], keep: int, ttl_s: float) -> None:
        """The newest `keep` of a list are kept, none longer than `ttl_s` unread."""
        if not values:
            return
        with self._redis_errors(f"push to {key}"):
            pipe = self._client.pipeline(transaction=True)
            pipe.rpush(key, *values)
            pipe.ltrim(key, -keep, -1)
            pipe.pexpire(key, max(1, int(ttl_s * 1000)))
            pipe.execute()

    def _take_unread(self, key: str) -> list[str]:
        with self._redis_errors(f"take from {key}"):
            pipe = self._client.pipeline(transaction=True)
            pipe.lrange(key, 0, -1)
            pipe.delete(key)
            values, _ = pipe.execute()
        return values

    # -- the controller ---------------------------------------------------------------------------

    def controller_heartbeat(self, ttl_s: float) -> None:
        """The deployment's controller is alive (disagg.controller): the key expires unless refreshed."""
        with self._redis_errors("controller_heartbeat"):
            self._client.set(f"{self.namespace}:controller", "alive", px=max(1, int(ttl_s * 1000)))

    def controller_alive(self) -> bool:
        """Whether the controller refreshed its key within its TTL."""
        with self._redis_errors("controller_alive"):
            return bool(self._client.exists(f"{self.namespace}:controller"))

    def controller_gone(self) -> None:
        """The controller stopped on purpose (`disagg stop`, a server's stop)."""
        with self._redis_errors("controller_gone"):
            self._client.delete(f"{self.namespace}:controller")

    # -- connection -------------------------------------------------------------------------------

    def ping(self) -> bool:
        """True if Redis answers; False (not an exception) when it cannot be reached: a health probe."""
        try:
            with self._redis_errors("ping"):
                return bool(self._client.ping())
        except RegistryUnavailable as exc:
            logger.debug("%s", exc)
            return False

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _arrival_text(at: float, prompt: int, output: int, ttft_ms=None, tpot_ms=None, priority: int = 0) -> str:
    targets = ("", "") if ttft_ms is None else (repr(float(ttft_ms)), repr(float(tpot_ms)))
    return ",".join((f"{at:.6f}", str(prompt), str(output), *targets, str(priority)))


def _arrival_of(value: str) -> tuple:
    """An arrival as `_arrival_text` wrote it (or as three fields, as before targets travelled)."""
    fields = value.split(",") + ["", "", "0"]
    at, prompt, output, ttft, tpot, priority = fields[:6]
    targets = (float(ttft), float(tpot)) if ttft else (None, None)
    return (float(at), int(prompt), int(output), *targets, int(priority))
