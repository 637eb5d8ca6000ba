"""A prefill instance: an engine in the PREFILL role whose KV streams to decode workers.

Plain Python; the Ray actor wraps it. Each request arrives with its KV targets (the decode
side's answer to the handshake). Layers stream out as the engine computes them; after the
first token the DONE goes out, and the request's blocks are freed on the decode side's
acknowledgement, or when the transfer fails or times out.
"""

from __future__ import annotations

from disagg.config import EngineConfig, Role
from disagg.engine.engine import LLMEngine
from disagg.engine.outputs import RequestOutput
from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.sender import KVSender, KVTarget
from disagg.kv_transfer.transport import Transport
from disagg.request import SamplingParams


class PrefillWorker:
    def __init__(self, config: EngineConfig, transport: Transport, kv_timeout: float = 30.0):
        self.engine = LLMEngine(config.replace(role=Role.PREFILL))
        self.transport = transport
        self.sender = KVSender(transport, self.engine.kv_cache, timeout=kv_timeout)
        self.engine.runner.on_layer = self.sender.on_layer
        self.engine.runner.on_forward_done = self.sender.on_step_end
        self.transfer_results: list[TransferResult] = []  # the latest step's, for metrics

    def address(self) -> str:
        return self.transport.address()

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, targets: list[KVTarget]) -> None:
        # Register the transfer first: the very first step may already stream layers.
        if targets:
            self.sender.add(request_id, targets)
        try:
            self.engine.add_request(request_id, prompt_token_ids=prompt_token_ids, sampling_params=sampling_params)
        except Exception:
            self.sender.abort(request_id)
            self.sender.poll()
            raise

    def abort(self, request_id: str) -> None:
        self.sender.abort(request_id)
        self.engine.abort_request(request_id)
        self.engine.release_kv(request_id)

    def step(self) -> list[RequestOutput]:
        """One engine step; first tokens go out with DONE; acknowledged blocks are freed."""
        outputs = self.engine.step()
        for out in outputs:
            if not out.finished:
                continue
            if self.sender.has_transfer(out.request_id):
                self.sender.finish(out.request_id, out.outputs[0].token_ids[0])
            else:  # nobody to send the KV to: nothing to hold it for
                self.engine.release_kv(out.request_id)
        self.transfer_results = self.sender.poll()
        for result in self.transfer_results:
            if result.ok:
                self.engine.release_kv(result.request_id)
            else:  # the prompt may still be computing: stop it too, wherever it is
                self.engine.abort_request(result.request_id)
        return outputs

    def is_idle(self) -> bool:
        """No request left to compute and no blocks held for a transfer."""
        return not self.engine.has_unfinished_requests() and not self.engine.scheduler.held_for_export

    def close(self) -> None:
        self.sender.close()
