"""The cluster-wide prefix index in Redis: which instance holds which KV block, in which tier.

One Redis hash per instance, `<ns>:kvindex:<id>`, block hash -> tier ("pool", "host", "disk"),
written by the instance's publisher (disagg.worker.prefix_publisher) and read by routers'
placement. Soft state, as the rest of Redis (DESIGN.md "Redis"): a marker key says the
instance's index is complete; after Redis restarted empty it is missing, and the publisher
writes the whole index again. An entry that is stale (the block left meanwhile) costs the
request a recompute, never an error. Keys lapse unless the publisher refreshes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import redis

from disagg.errors import RegistryUnavailable
from disagg.registry import redact_url, redis_client

# A drop unlists the block only if the tier dropping it is the last one the index heard of
# (a block loaded back into the pool stays listed there when its host copy goes).
_DROP_IF_TIER = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""
REPUBLISH_CHUNK = 10_000  # fields per HSET when the whole index is written


class PrefixIndex:
    def __init__(self, url: str, namespace: str = "disagg", timeout_s: float = 1.0):
        self.namespace = namespace
        self._safe_url = redact_url(url)
        self._client = redis_client(url, timeout_s)
        self._drop = self._client.register_script(_DROP_IF_TIER)

    def _key(self, instance_id: str) -> str:
        return f"{self.namespace}:kvindex:{instance_id}"

    def _marker(self, instance_id: str) -> str:
        return f"{self.namespace}:kvindex-complete:{instance_id}"

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as exc:
            raise RegistryUnavailable(f"prefix index {what} failed: Redis at {self._safe_url}: {exc}") from exc

    # ---- the worker's side ---------------------------------------------------------------------
    def apply(self, instance_id: str, events: Iterable[tuple[str, int, str]], ttl_s: float) -> bool:
        """Apply (kind, block hash, tier) events in order and refresh the keys' lifetime. False:
        the index is not complete in Redis (it restarted, or never had it): republish."""
        key, marker, ttl_ms = self._key(instance_id), self._marker(instance_id), int(ttl_s * 1000)
        with self._errors("update"):
            pipe = self._client.pipeline(transaction=False)
            pipe.exists(marker)
            for kind, block_hash, tier in events:
                if kind == "store":
                    pipe.hset(key, str(block_hash), tier)
                else:
                    self._drop(keys=[key], args=[str(block_hash), tier], client=pipe)
            pipe.pexpire(key, ttl_ms)
            pipe.pexpire(marker, ttl_ms)
            return bool(pipe.execute()[0])

    def republish(self, instance_id: str, entries: dict[int, str], ttl_s: float) -> None:
        """Replace the instance's whole index with `entries` (block hash -> tier)."""
        key, marker, ttl_ms = self._key(instance_id), self._marker(instance_id), int(ttl_s * 1000)
        items = [(str(h), tier) for h, tier in entries.items()]
        with self._errors("republish"):
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(key)
            for i in range(0, len(items), REPUBLISH_CHUNK):
                pipe.hset(key, mapping=dict(items[i : i + REPUBLISH_CHUNK]))
            pipe.pexpire(key, ttl_ms)
            pipe.set(marker, "1", px=ttl_ms)
            pipe.execute()

    def forget(self, instance_id: str) -> None:
        with self._errors("forget"):
            self._client.delete(self._key(instance_id), self._marker(instance_id))

    # ---- the router's side -----------------------------------------------------------------------
    def read(self, instance_ids: Iterable[str]) -> dict[str, dict[int, str]]:
        """Each instance's index: block hash -> tier (empty where it has none)."""
        ids = list(instance_ids)
        if not ids:
            return {}
        with self._errors("read"):
            pipe = self._client.pipeline(transaction=False)
            for instance_id in ids:
                pipe.hgetall(self._key(instance_id))
            replies = pipe.execute()
        return {i: {int(h): tier for h, tier in reply.items()} for i, reply in zip(ids, replies)}

    def close(self) -> None:
        self._client.close()
