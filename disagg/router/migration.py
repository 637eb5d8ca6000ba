"""A request that outlives its instances: what a client has been sent so far, and the request
that continues it elsewhere when an instance fails.

When the decode instance streaming a request dies (its link breaks, its KV never arrives), or
the prefill instance computing its prompt does, the router starts the request again on healthy
instances with the prompt plus every token already streamed, asking only for the tokens still
due. The new prefill recomputes that context (Dynamo's approach), so no KV has to survive the
failure. Greedy output is unchanged; a seeded request continues its random stream, because each
token's noise depends on (seed, token index) alone (`SamplingParams.resumed_tokens`). The client
sees one stream: no token repeated or missing, counts as if nothing had happened.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from disagg.errors import KVTransferError, RemoteError, WorkerLinkError
from disagg.request import SamplingParams
from disagg.rpc.messages import TokenDelta


def is_migratable(exc: BaseException) -> bool:
    """Failures that say nothing about the request itself: another instance may well serve it.
    A worker's UNAVAILABLE is one (it failed, not the request: disagg.rpc.server)."""
    if isinstance(exc, (WorkerLinkError, KVTransferError)):
        return True
    return isinstance(exc, RemoteError) and exc.grpc_code_name == "UNAVAILABLE"


@dataclass
class Progress:
    """One request across its attempts."""

    prompt_token_ids: list[int]
    params: SamplingParams
    streamed: list[int] = field(default_factory=list)  # output tokens the client has been sent
    migrations: int = 0
    expected_output_tokens: int | None = None  # of the whole request (disagg.router.output_lengths)

    def attempt_id(self, request_id: str) -> str:
        """The id the workers know this attempt by: a new one after each migration, so that what
        is left of an earlier attempt (an abort still on its way) never meets the next one."""
        return request_id if not self.migrations else f"{request_id}~{self.migrations}"

    def attempt_prompt(self) -> list[int]:
        return self.prompt_token_ids + self.streamed

    def attempt_params(self) -> SamplingParams:
        if not self.streamed:
            return self.params
        done = len(self.streamed)
        return dataclasses.replace(self.params, max_tokens=self.params.max_tokens - done, resumed_tokens=done)

    def attempt_expected_output(self) -> int | None:
        """What the next attempt is expected to write: the rest of the expectation, at least 1
        and no more than it may write."""
        if self.expected_output_tokens is None:
            return None
        return max(1, min(self.expected_output_tokens - len(self.streamed), self.attempt_params().max_tokens))

    def record(self, delta: TokenDelta) -> TokenDelta:
        """Count a delta of the current attempt as streamed; its counts as of the whole request
        (an instance's own count differs after a migration, or a live move)."""
        self.streamed.extend(delta.token_ids)
        delta.num_prompt_tokens = len(self.prompt_token_ids)
        delta.num_output_tokens = len(self.streamed)
        return delta
