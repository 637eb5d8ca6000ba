"""The request path's remote services, declared once: what the router may call on rank 0 of an
instance, with what, and what comes back.

The worker (disagg.worker.actor) derives from `WorkerService`, both services, and implements
each method in one line that runs its role's method (it may return a concurrent Future of the
reply, completed by the engine thread); the router's stubs (disagg.rpc.stubs) derive from one
service each and send the call over the instance's request link. So go-to-definition leads from
the orchestrator to the declaration here, and "go to implementations" to the worker, then to the
role. On the wire a call names its method; the server dispatches only to the methods its service
declares (`method_names`).

A request's `priority` is the engine's (disagg.request.PRIORITY_VALUES: lower runs first): it
orders the instance's queue, batch and preemption (disagg.engine.queue_order).
"""

from __future__ import annotations

from disagg.kv_transfer.layout import KVLayout
from disagg.request import SamplingParams
from disagg.rpc.messages import PrefillResult, Reservation

TOKENS_TOPIC = "tokens"  # decode and colocated instances stream list[TokenDelta] events under it


class PrefillService:
    """Rank 0 of a prefill instance."""

    def prefill(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> PrefillResult:
        """Compute the prompt and answer its first token (this sets the request's TTFT). The
        prefill starts at once; its KV stays in this instance's blocks until `set_kv_targets`
        says where it goes (or the KV timeout drops the request)."""
        raise NotImplementedError

    def set_kv_targets(self, request_id: str, reservation: Reservation) -> bool:
        """Where the request's KV goes: the decode instance's answer to the handshake. False if
        the request is gone (aborted, timed out)."""
        raise NotImplementedError

    def abort(self, request_id: str) -> bool:
        """Drop the request and free its blocks; False if it was not here."""
        raise NotImplementedError


class DecodeService:
    """Rank 0 of a decode (or colocated) instance. Its tokens stream back on the link that asked,
    one TOKENS_TOPIC event per engine step with the new tokens of all that link's requests."""

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill: KVLayout,
        kv_wait_s: float,
        priority: int = 0,
    ) -> Reservation | None:
        """The handshake: allocate the prompt's blocks on every rank and listen to the prefill
        ranks that hold each slice of its KV. None when there is no room now. The first KV must
        arrive within `kv_wait_s` (the router's prediction of the prefill's queue, plus margin);
        after that, each arrival extends the wait (disagg.kv_transfer.receiver)."""
        raise NotImplementedError

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Run the whole request here (colocated, or a local prefill on a decode instance)."""
        raise NotImplementedError

    def abort(self, request_id: str) -> bool:
        """Drop the request and free its blocks; False if it was not here."""
        raise NotImplementedError

    # Live migration (disagg.decode_worker.migration): a decoding request moves from a source
    # instance to a target with its KV: the target reserves, the source pre-copies, pauses and
    # sends the rest with the request's tokens. A one-rank DECODE instance only.
    def migration_layout(self) -> KVLayout | None:
        """Where requests moving out of here send their KV from (None: they cannot move out)."""
        raise NotImplementedError

    def reserve_migration(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        num_prompt_tokens: int,
        source: KVLayout,
        capacity_tokens: int,
        kv_wait_s: float,
        priority: int = 0,
    ) -> Reservation | None:
        """Target: blocks for a request moving here from `source`: its attempt (`params`, a prompt
        of `num_prompt_tokens`, `priority`) has `token_ids` with KV now; room for `capacity_tokens` positions.
        Its tokens stream on this link once it decodes here (the first after those the source
        sent). None when there is no room."""
        raise NotImplementedError

    def migrate_out(self, request_id: str, reservation: Reservation) -> list[int]:
        """Source: move a decoding request into the target's reservation. Answers once it paused
        here: its tokens then (the last one sampled, its KV not computed); the target gets them
        with the KV. Fails (and the request goes on here) when it cannot."""
        raise NotImplementedError


class PeerBlockService:
    """Rank 0 of a one-rank prefill or decode instance: cached prefix blocks lent from one
    instance to a prefill instance that lacks them (disagg.kv_transfer.peer_blocks). The
    router asks the holder where it lends from, the prefill instance for a slot, then the holder
    to send; `abort(fetch id)` on either side ends a fetch that the router gave up on."""

    def peer_export_layout(self) -> KVLayout | None:
        """Where this instance lends cached blocks from (None: it lends none)."""
        raise NotImplementedError

    def reserve_peer_import(
        self, import_id: str, token_ids: list[int], num_blocks: int, source: KVLayout
    ) -> Reservation | None:
        """A prefill instance: blocks for the first `num_blocks` full blocks of `token_ids`,
        those it lacks to come from `source`; None when it lacks none or has no room."""
        raise NotImplementedError

    def export_prefix(self, export_id: str, token_ids: list[int], num_blocks: int, slot: Reservation) -> bool:
        """The holder: send the first `num_blocks` full blocks of `token_ids` into a prefill
        instance's `slot`. True once they are in; False when this instance no longer holds them
        (a stale index entry) or the transfer failed."""
        raise NotImplementedError


class WorkerService(PrefillService, DecodeService, PeerBlockService):
    """What every worker serves: all three services, whichever role it holds now. A call of the
    role it does not hold is refused (UNAVAILABLE); `abort` goes to the role held."""


def method_names(service: type) -> frozenset[str]:
    """The remote methods a service declares (its public functions, and its bases': a service
    may be the union of others, as the worker's is)."""
    return frozenset(
        name
        for cls in service.__mro__
        if cls is not object
        for name, value in vars(cls).items()
        if callable(value) and not name.startswith("_")
    )
