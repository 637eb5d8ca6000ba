"""Which decoding requests to move, and where, so that no decode instance runs a batch whose
TPOT is predicted to miss the target while another has room (issue 36: live migration used for
rebalancing, as Llumnix does).

Placement decides on the batches of the moment a request arrives; requests then end unevenly (one
instance keeps the long outputs), and a batch can outgrow its TPOT while a peer idles. Each round
prices every decode instance's batch as it stands (the step model and residual the goodput policy
predicts TPOT with) and, from the instance predicted slowest, hands requests one at a time to the
instance predicted fastest with it, while the source is predicted over the target and the
receiver stays under it with `margin` to spare (so that the move does not make a new miss, and
two instances never trade a request back and forth). The request with the least context moves
first: its KV is the cheapest to copy. Pure: the router applies the moves (disagg.router.live_moves).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from disagg.placement.predictor import DecodeSide

D = TypeVar("D", bound=DecodeSide)
R = TypeVar("R")
MARGIN = 0.15  # a receiver's predicted TPOT stays this far under the target
MAX_MOVES = 4  # per round: the next round sees their effect in the reports


@dataclass(frozen=True)
class Move(Generic[R, D]):
    request: R
    source: D
    target: D


def batch_tpot_ms(decode: DecodeSide, extra_requests: int = 0, extra_context: int = 0) -> float:
    """The decode step of `decode`'s batch now (with requests and context added, or taken away
    where negative): what every request of it waits per token."""
    batch = decode.decode_batch + extra_requests
    if batch <= 0:
        return 0.0
    step = decode.step_model.decode_ms(batch, max(0, decode.decode_context_tokens + extra_context))
    return step + decode.tpot_residual_ms(step)


def rebalance(
    decodes: Sequence[D],
    requests_on: Callable[[D], list[R]],
    context_of: Callable[[R], int],
    tpot_ms: float,
    margin: float = MARGIN,
    max_moves: int = MAX_MOVES,
) -> list[Move[R, D]]:
    """The moves of one round (none without a target, or with fewer than two instances). An
    instance whose decode steps are not fitted yet takes no part: a guess moves nothing."""
    decodes = [d for d in decodes if d.decode_calibrated]
    if tpot_ms <= 0 or len(decodes) < 2:
        return []
    added = {id(d): [0, 0] for d in decodes}  # requests and context tokens moved in (negative: out)

    def predicted(d: D, requests: int = 0, context: int = 0) -> float:
        return batch_tpot_ms(d, added[id(d)][0] + requests, added[id(d)][1] + context)

    moves: list[Move[R, D]] = []
    for source in sorted(decodes, key=predicted, reverse=True):
        for request in sorted(requests_on(source), key=context_of):
            if len(moves) >= max_moves or predicted(source) <= tpot_ms:
                break
            context = context_of(request)
            target = min((d for d in decodes if d is not source), key=lambda d: predicted(d, 1, context))
            if predicted(target, 1, context) > tpot_ms * (1 - margin):
                break  # nowhere has room for it: the source stays as it is
            moves.append(Move(request, source, target))
            added[id(source)][0] -= 1
            added[id(source)][1] -= context
            added[id(target)][0] += 1
            added[id(target)][1] += context
    return moves
