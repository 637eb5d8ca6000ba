"""The interfaces the engine calls and others implement: its KV connector and its followers.

The split follows vLLM v1's KV connector. The worker side is what the model runner calls: once
the engine has allocated its cache (`register_kv_cache`), after each layer of a step has written
its KV (`save_kv_layer`), and after the forward pass (`forward_done`). The other side is what the
worker's loop calls between steps: `poll` for finished transfers, `abort`, `close`. The engine
imports no transfer code; the data plane (disagg.kv_transfer) provides the implementations.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from disagg.engine.kv_cache import KVCache


@dataclass
class TransferResult:
    """One request's transfer on one rank, finished either way."""

    request_id: str
    ok: bool
    first_token: int = -1
    error: str | None = None
    seconds: float = 0.0
    num_bytes: int = 0
    token_ids: list[int] | None = None  # a moving request's tokens at its pause (MsgType.TOKENS), if sent


class KVConnector(abc.ABC):
    # ---- worker side: the model runner ---------------------------------------------------------
    @abc.abstractmethod
    def register_kv_cache(self, kv_cache: KVCache) -> None:
        """The engine allocated its cache: the blocks that transfers read or write."""

    @property
    def saves_layers(self) -> bool:
        """Whether the runner should call `save_kv_layer` (a sender); a receiver saves nothing."""
        return False

    def save_kv_layer(self, local_layer: int, chunks: Sequence[Any]) -> None:
        """Layer `local_layer` of this step (chunks in the runner's order) holds its new KV."""

    def forward_done(self, chunks: Sequence[Any]) -> None:
        """Every layer of this step is computed."""

    def step_failed(self, chunks: Sequence[Any]) -> None:
        """The step raised part way: forget what it half sent of these chunks (they run again)."""

    # ---- scheduler side: the worker's loop, between steps ----------------------------------------
    @abc.abstractmethod
    def poll(self) -> list[TransferResult]:
        """Transfers that finished since the last poll; also enforces their deadlines."""

    @abc.abstractmethod
    def has_finished(self) -> bool:
        """A lock-free peek: whether `poll` would return something."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Give up on a request's transfers; no later write touches its blocks."""

    @abc.abstractmethod
    def close(self) -> None: ...


class PendingStep(Protocol):
    def result(self) -> Any:
        """Wait for the other ranks' part of the step; the last stage's logits, or None."""


class Followers(Protocol):
    """Rank 0's handle on the other ranks of a multi-worker instance (disagg.worker.shard_group)."""

    def submit(self, chunks: Sequence[Any]) -> PendingStep:
        """Start the step on every other rank before rank 0 computes its part."""
