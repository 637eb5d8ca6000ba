"""Live migration: a decoding request moves to another decode instance with its KV, and its
stream goes on there with no token repeated, missing or different (Llumnix's pre-copy).

Source side (`MigrationSource`, on the engine thread of the instance that decodes it; each move
is held by its request's record in the decode role):

    PRECOPY -> AWAITING_ACK -> DONE | FAILED

PRECOPY: the KV computed so far goes out at once (by reference on one host, packed between
hosts: the same KVSender and protocol as a prefill's), while the request keeps decoding here.
After `precopy_steps` more steps it pauses at a step boundary (out of the batch, blocks kept):
only what those steps wrote goes out then, with the request's tokens (a TOKENS message), and the
DONE carries the last sampled token. The pause lasts from there to the target's first step. AWAITING_ACK: on the target's
acknowledgement the blocks here are freed (DONE); if the transfer fails, the request resumes
here from where it paused (FAILED): a move that fails loses nothing.

Target side (`reserve_arrival`, `finish_arrival`): blocks are reserved for the tokens known when the move starts
plus room for those the source adds before it pauses; the request joins the batch at the first
step boundary after its KV and tokens are in, with no other party's word needed.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

from disagg.engine.engine import LLMEngine
from disagg.engine.outputs import RequestOutput
from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVTarget
from disagg.kv_transfer.sender import KVSender
from disagg.request import SamplingParams

logger = logging.getLogger(__name__)
PRECOPY_STEPS = 1  # decode steps the request keeps running here while its earlier KV is copied
# A request pauses only between two single-token steps; after tokens its grammar forced
# (jump-forward) it waits for their KV, at most this many steps, before the move gives up.
MAX_PAUSE_WAIT_STEPS = 16


class MigrationState(enum.Enum):
    PRECOPY = "precopy"
    AWAITING_ACK = "awaiting_ack"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Outgoing:
    request_id: str
    steps_left: int
    state: MigrationState = MigrationState.PRECOPY
    pause_waits: int = 0  # steps the pause waited for forced tokens' KV
    paused: Future = field(default_factory=Future)  # the request's tokens at the pause
    done: Future = field(default_factory=Future)  # True: it runs there now; False: it went on here


class MigrationSource:
    """Moves requests out of this engine (engine thread only, except the futures). Each move
    lives in its request's record (disagg.decode_worker.role); this counts those under way."""

    def __init__(self, engine: LLMEngine, sender: KVSender, precopy_steps: int = PRECOPY_STEPS):
        self.engine = engine
        self.sender = sender
        self.precopy_steps = precopy_steps
        self.num_moving = 0

    @property
    def active(self) -> bool:
        return self.num_moving > 0

    def start(self, request_id: str, targets: list[KVTarget]) -> Outgoing:
        """Begin moving a decoding request to `targets` (the target's reservation, per rank)."""
        request = self.engine.scheduler.requests.get(request_id)
        if request is None or request not in self.engine.scheduler.running:
            raise ValueError(f"migrate: {request_id!r} is not decoding here")
        move = Outgoing(request_id, self.precopy_steps)
        self.num_moving += 1
        self.sender.add(request_id, targets)
        self.sender.catch_up(request_id, request.block_ids, request.num_computed_tokens)
        return move

    def before_step(self, moves: Iterable[Outgoing]) -> None:
        """Between steps: moves whose pre-copy is over pause now; a request that ended or was
        preempted here meanwhile has nothing left to move."""
        for move in [m for m in moves if m.state is MigrationState.PRECOPY]:
            request = self.engine.scheduler.requests.get(move.request_id)
            if request is None or request not in self.engine.scheduler.running:
                self._fail(move, "the request ended or was preempted before it could move")
            elif move.steps_left > 0:
                move.steps_left -= 1
            elif request.num_tokens - request.num_computed_tokens != 1:
                move.pause_waits += 1  # forced tokens wait for their KV: the move cannot carry them
                if move.pause_waits > MAX_PAUSE_WAIT_STEPS:
                    self._fail(move, "its grammar kept forcing tokens; it decodes here on")
            else:
                self._pause(move)

    def after_step(self, move_of: Callable[[str], Outgoing | None]) -> None:
        """Transfers that ended: free what moved, resume what could not (`move_of`: a request's
        move under way, or None)."""
        for result in self.sender.poll():
            move = move_of(result.request_id)
            if move is not None:
                self._settle(move, result)

    def abort(self, move: Outgoing) -> None:
        """Its request is being aborted here: stop moving it (its blocks go with the abort)."""
        self._end(move, MigrationState.FAILED)
        self.sender.abort(move.request_id)
        _resolve(move, "aborted", resumed=False)

    def _pause(self, move: Outgoing) -> None:
        tokens = self.engine.pause_request(move.request_id)
        request = self.engine.scheduler.requests[move.request_id]  # paused
        self.sender.catch_up(move.request_id, request.block_ids, request.num_computed_tokens)
        self.sender.send_tokens(move.request_id, tokens)
        self.sender.finish(move.request_id, tokens[-1])
        move.state = MigrationState.AWAITING_ACK
        move.paused.set_result(tokens)

    def _settle(self, move: Outgoing, result: TransferResult) -> None:
        if result.ok and move.state is MigrationState.AWAITING_ACK:
            self.engine.release_paused(move.request_id)
            self._end(move, MigrationState.DONE)
            move.done.set_result(True)
            return
        logger.warning("request %s could not move: %s", move.request_id, result.error)
        resumed = move.state is MigrationState.AWAITING_ACK
        if resumed:
            self.engine.resume_request(move.request_id)
        self._end(move, MigrationState.FAILED)
        _resolve(move, result.error or "the transfer failed", resumed)

    def _fail(self, move: Outgoing, reason: str) -> None:
        self._end(move, MigrationState.FAILED)
        self.sender.abort(move.request_id)
        _resolve(move, reason, resumed=False)

    def _end(self, move: Outgoing, state: MigrationState) -> None:
        move.state = state
        self.num_moving -= 1


def _resolve(move: Outgoing, reason: str, resumed: bool) -> None:
    if not move.paused.done():
        move.paused.set_exception(MigrationFailed(move.request_id, reason))
    if not move.done.done():
        move.done.set_result(False)
    if resumed:
        logger.info("request %s decodes here again", move.request_id)


class MigrationFailed(RuntimeError):
    def __init__(self, request_id: str, reason: str):
        super().__init__(f"request {request_id} could not move: {reason}")
        self.request_id = request_id


def continued_params(params: SamplingParams, num_prompt_tokens: int, num_tokens: int) -> SamplingParams:
    """The params a request decodes on with at its target: `params` were its attempt's, for a
    prompt of `num_prompt_tokens`; it moves with `num_tokens` (the last one its target's first
    output). The outputs before that one count as done: max_tokens shrinks by them, and seeded
    noise goes on at the right index (SamplingParams.resumed_tokens)."""
    done = num_tokens - num_prompt_tokens - 1
    if done < 0:
        raise ValueError(f"migration: {num_tokens} tokens do not reach past the {num_prompt_tokens}-token prompt")
    return dataclasses.replace(params, max_tokens=params.max_tokens - done, resumed_tokens=params.resumed_tokens + done)


@dataclass
class Incoming:
    """A request moving here, until its KV and tokens are in (held by its record)."""

    num_prompt_tokens: int
    params: SamplingParams  # its attempt's
    kv: TransferResult | None = None


def reserve_arrival(
    engine: LLMEngine,
    request_id: str,
    token_ids: list[int],
    params: SamplingParams,
    num_prompt_tokens: int,
    capacity_tokens: int,
    priority: int = 0,
) -> tuple[list[int], Incoming] | None:
    """Blocks for a request whose attempt (`params`, a prompt of `num_prompt_tokens`) has
    `token_ids` with KV so far, and what its arrival needs; None when there is no room. It keeps
    its `priority` here (the request object made now is the one that decodes:
    finish_migration_import keeps it)."""
    known = continued_params(params, num_prompt_tokens, len(token_ids) + 1)
    block_ids = engine.reserve_for_migration(request_id, token_ids, known, capacity_tokens, priority)
    if block_ids is None:
        return None
    return block_ids, Incoming(num_prompt_tokens, params)


def finish_arrival(engine: LLMEngine, request_id: str, incoming: Incoming) -> RequestOutput:
    """Its KV and tokens are in: it decodes here from now on (its first output carries the last
    token the source sampled, which the client already has). ValueError (the caller aborts it)
    when its tokens did not come with its KV."""
    tokens = incoming.kv.token_ids
    if not tokens or incoming.kv.first_token != tokens[-1]:
        raise ValueError(f"migration of {request_id}: its tokens did not come with its KV")
    params = continued_params(incoming.params, incoming.num_prompt_tokens, len(tokens))
    return engine.finish_migration_import(request_id, tokens[:-1], tokens[-1], params)
