"""A decode instance: an engine in the DECODE role that takes KV from prefill workers.

Plain Python; the Ray actor wraps it. `reserve` is the handshake: blocks for the prompt are
allocated now and their ids returned, and the receiver starts listening to the prefill ranks.
When the KV and the first token are in, the request joins the decode batch.

The same worker without a transport (COLOCATED role) runs whole requests itself with chunked
prefill: the baseline that disaggregation is measured against.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.config import EngineConfig, Role
from disagg.engine.engine import LLMEngine
from disagg.engine.outputs import RequestOutput
from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.receiver import KVReceiver
from disagg.kv_transfer.transport import Transport
from disagg.request import SamplingParams


@dataclass(frozen=True)
class Reservation:
    transfer_id: int
    block_ids: list[int]


@dataclass(frozen=True)
class FailedRequest:
    request_id: str
    error: str


class DecodeWorker:
    def __init__(self, config: EngineConfig, transport: Transport | None, kv_timeout: float = 30.0):
        role = Role.DECODE if transport is not None else Role.COLOCATED
        self.engine = LLMEngine(config.replace(role=role))
        self.transport = transport
        self.receiver = KVReceiver(transport, self.engine.kv_cache, timeout=kv_timeout) if role is Role.DECODE else None
        self.failed: list[FailedRequest] = []  # the latest step's transfer failures
        self.transfer_results: list[TransferResult] = []

    def address(self) -> str:
        return self.transport.address() if self.transport is not None else ""

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """COLOCATED role: run the whole request here."""
        self.engine.add_request(request_id, prompt_token_ids=prompt_token_ids, sampling_params=sampling_params)

    def reserve(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, sources: dict[str, str], kv_timeout: float | None = None) -> Reservation | None:
        """Pre-allocate the prompt's blocks and listen for them; None when there is no room now.
        The KV must be in within `kv_timeout` seconds (default: the worker's), else the request fails."""
        block_ids = self.engine.reserve_for_remote_prefill(request_id, prompt_token_ids, sampling_params)
        if block_ids is None:
            return None
        return Reservation(self.receiver.expect(request_id, block_ids, sources, kv_timeout), block_ids)

    def abort(self, request_id: str) -> bool:
        if self.receiver is not None:
            self.receiver.cancel(request_id)  # before the blocks are freed: no late write lands in them
        return self.engine.abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        """Admit requests whose KV arrived (their first-token output comes first), then decode."""
        outputs = []
        self.failed = []
        self.transfer_results = self.receiver.poll() if self.receiver is not None else []
        for result in self.transfer_results:
            if result.ok:
                outputs.append(self.engine.finish_kv_import(result.request_id, result.first_token))
            else:
                self.engine.abort_request(result.request_id)
                self.failed.append(FailedRequest(result.request_id, result.error or "KV transfer failed"))
        outputs.extend(self.engine.step())
        return outputs

    def is_idle(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
