"""The router's stubs of the remote services: each method sends the call over the instance's
request link (disagg.rpc.client) and awaits its reply. They derive from the service they call,
so reading the orchestrator leads here, then to the declaration and the worker's implementation.
"""

from __future__ import annotations

import asyncio

from disagg.kv_transfer.layout import KVLayout
from disagg.request import SamplingParams
from disagg.rpc.client import RpcClient
from disagg.rpc.messages import PrefillResult, Reservation
from disagg.rpc.services import DecodeService, PeerBlockService, PrefillService


class PrefillStub(PrefillService):
    def __init__(self, link: RpcClient):
        self.link = link

    async def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> "asyncio.Future[PrefillResult]":
        """Sends the call now and returns at once: awaiting the returned future gives the first
        token, so the handshake with the decode side can run while the prompt computes."""
        return await self.link.submit(PrefillService.prefill, request_id, prompt_token_ids, params, priority)

    async def set_kv_targets(self, request_id: str, reservation: Reservation, *, timeout_s: float) -> bool:
        return await self.link.call(PrefillService.set_kv_targets, request_id, reservation, timeout_s=timeout_s)

    async def abort(self, request_id: str, *, timeout_s: float) -> bool:
        return await self.link.call(PrefillService.abort, request_id, timeout_s=timeout_s)


class DecodeStub(DecodeService):
    def __init__(self, link: RpcClient):
        self.link = link

    async def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill: KVLayout,
        kv_wait_s: float,
        priority: int = 0,
        *,
        timeout_s: float,
    ) -> Reservation | None:
        return await self.link.call(
            DecodeService.reserve, request_id, prompt_token_ids, params, prefill, kv_wait_s, priority,
            timeout_s=timeout_s,
        )  # fmt: skip

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        *,
        timeout_s: float,
    ) -> None:
        return await self.link.call(
            DecodeService.submit, request_id, prompt_token_ids, params, priority, timeout_s=timeout_s
        )

    async def abort(self, request_id: str, *, timeout_s: float) -> bool:
        return await self.link.call(DecodeService.abort, request_id, timeout_s=timeout_s)

    async def migration_layout(self, *, timeout_s: float) -> KVLayout | None:
        return await self.link.call(DecodeService.migration_layout, timeout_s=timeout_s)

    async def reserve_migration(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        num_prompt_tokens: int,
        source: KVLayout,
        capacity_tokens: int,
        kv_wait_s: float,
        priority: int = 0,
        *,
        timeout_s: float,
    ) -> Reservation | None:
        return await self.link.call(
            DecodeService.reserve_migration, request_id, token_ids, params, num_prompt_tokens, source,
            capacity_tokens, kv_wait_s, priority, timeout_s=timeout_s,
        )  # fmt: skip

    async def migrate_out(self, request_id: str, reservation: Reservation, *, timeout_s: float) -> list[int]:
        return await self.link.call(DecodeService.migrate_out, request_id, reservation, timeout_s=timeout_s)


class PeerStub(PeerBlockService):
    def __init__(self, link: RpcClient):
        self.link = link

    async def peer_export_layout(self, *, timeout_s: float) -> KVLayout | None:
        return await self.link.call(PeerBlockService.peer_export_layout, timeout_s=timeout_s)

    async def reserve_peer_import(
        self, import_id: str, token_ids: list[int], num_blocks: int, source: KVLayout, *, timeout_s: float
    ) -> Reservation | None:
        return await self.link.call(
            PeerBlockService.reserve_peer_import, import_id, token_ids, num_blocks, source, timeout_s=timeout_s
        )

    async def export_prefix(
        self, export_id: str, token_ids: list[int], num_blocks: int, slot: Reservation, *, timeout_s: float
    ) -> bool:
        return await self.link.call(
            PeerBlockService.export_prefix, export_id, token_ids, num_blocks, slot, timeout_s=timeout_s
        )

    async def abort(self, request_id: str, *, timeout_s: float) -> bool:
        return await self.link.call(PrefillService.abort, request_id, timeout_s=timeout_s)
