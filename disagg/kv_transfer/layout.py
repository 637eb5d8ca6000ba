"""Where each KV slice of an instance lives, and who sends what to whom between two instances.

An instance of TP x PP workers has one KV endpoint per rank. `KVLayout` lists them; with the
resharding map (`plan_kv_routes`) it answers the two questions of the handshake: which prefill
ranks a decode rank listens to (`sources_for`), and which decode ranks a prefill rank streams to
and which part (`targets_for`). Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.kv_transfer.resharding import ParallelPlan, plan_kv_routes


@dataclass(frozen=True)
class KVTarget:
    """One decode rank that receives (part of) one request's KV."""

    peer_id: str
    peer_address: str
    transfer_id: int  # the receiver's id for this transfer
    block_ids: list[int]  # the receiver's pre-allocated blocks, in order
    layers: tuple[int, int]  # global layer range this target takes from us
    heads: tuple[int, int]  # global KV head range this target takes from us


@dataclass(frozen=True)
class KVRank:
    peer_id: str
    address: str
    tp_rank: int = 0
    pp_rank: int = 0

    @property
    def place(self) -> tuple[int, int]:
        return (self.tp_rank, self.pp_rank)


@dataclass(frozen=True)
class KVLayout:
    tp: int
    pp: int
    ranks: tuple[KVRank, ...]

    @property
    def plan(self) -> ParallelPlan:
        return ParallelPlan(self.tp, self.pp)

    def at(self, place: tuple[int, int]) -> KVRank:
        for rank in self.ranks:
            if rank.place == place:
                return rank
        raise ValueError(f"kv layout: no rank at (tp, pp) = {place}")

    def to_list(self) -> list[list]:
        """JSON-friendly form, as the registry stores it."""
        return [[r.peer_id, r.address, r.tp_rank, r.pp_rank] for r in self.ranks]

    @classmethod
    def from_list(cls, tp: int, pp: int, rows: list[list]) -> "KVLayout":
        return cls(tp, pp, tuple(KVRank(str(p), str(a), int(t), int(s)) for p, a, t, s in rows))

    @classmethod
    def single(cls, peer_id: str, address: str) -> "KVLayout":
        return cls(1, 1, (KVRank(peer_id, address),))


def sources_for(
    place: tuple[int, int], prefill: KVLayout, decode_plan: ParallelPlan, num_layers: int, num_kv_heads: int
) -> dict[str, str]:
    """The prefill ranks (peer id -> address) that the decode rank at `place` receives from."""
    routes = plan_kv_routes(num_layers, num_kv_heads, prefill.plan, decode_plan)
    return {prefill.at(r.src).peer_id: prefill.at(r.src).address for r in routes if r.dst == place}


def targets_for(
    place: tuple[int, int],
    prefill_plan: ParallelPlan,
    decode: KVLayout,
    transfer_ids: dict[str, int],
    block_ids: list[int],
    num_layers: int,
    num_kv_heads: int,
) -> list[KVTarget]:
    """What the prefill rank at `place` streams, to which decode rank, into which transfer."""
    targets = []
    for route in plan_kv_routes(num_layers, num_kv_heads, prefill_plan, decode.plan):
        if route.src == place:
            dst = decode.at(route.dst)
            targets.append(
                KVTarget(dst.peer_id, dst.address, transfer_ids[dst.peer_id], block_ids, route.layers, route.heads)
            )
    return targets
