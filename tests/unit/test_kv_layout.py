"""The handshake's routing between instances of different parallel plans, and the per-rank tally."""

from __future__ import annotations

import pytest

from disagg.kv_transfer.endpoint import TransferResult
from disagg.kv_transfer.layout import KVLayout, KVRank, sources_for, targets_for
from disagg.kv_transfer.tally import RankTally

LAYERS, HEADS = 4, 8


def layout(name: str, tp: int, pp: int) -> KVLayout:
    return KVLayout(
        tp, pp, tuple(KVRank(f"{name}{t}{p}", f"addr-{name}{t}{p}", t, p) for p in range(pp) for t in range(tp))
    )


@pytest.mark.parametrize("src,dst", [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((2, 1), (1, 2)), ((1, 2), (2, 2))])
def test_targets_and_sources_agree(src, dst):
    prefill, decode = layout("p", *src), layout("d", *dst)
    transfer_ids = {r.peer_id: i for i, r in enumerate(decode.ranks)}
    sent = {}  # decode peer -> set of (layer, head) it receives, and from whom
    for rank in prefill.ranks:
        for t in targets_for(rank.place, prefill.plan, decode, transfer_ids, [7, 3], LAYERS, HEADS):
            assert t.transfer_id == transfer_ids[t.peer_id] and t.block_ids == [7, 3]
            cells = {(layer, head) for layer in range(*t.layers) for head in range(*t.heads)}
            assert not cells & sent.get(t.peer_id, {}).get("cells", set()), "a slice sent twice"
            entry = sent.setdefault(t.peer_id, {"cells": set(), "from": set()})
            entry["cells"] |= cells
            entry["from"].add(rank.peer_id)
    for rank in decode.ranks:
        tp_size, pp_size = dst
        heads = HEADS // tp_size
        layers = LAYERS // pp_size
        wanted = {
            (layer, head)
            for layer in range(rank.pp_rank * layers, (rank.pp_rank + 1) * layers)
            for head in range(rank.tp_rank * heads, (rank.tp_rank + 1) * heads)
        }
        assert sent[rank.peer_id]["cells"] == wanted
        # The decode rank listens to exactly the prefill ranks that send to it.
        assert set(sources_for(rank.place, prefill, decode.plan, LAYERS, HEADS)) == sent[rank.peer_id]["from"]


def test_layout_round_trips_through_the_registry_form():
    original = layout("x", 2, 2)
    assert KVLayout.from_list(2, 2, original.to_list()) == original
    with pytest.raises(ValueError, match="no rank"):
        original.at((3, 0))


def test_tally_reports_once_when_every_rank_is_done():
    tally = RankTally(3)
    assert tally.add(TransferResult("a", True, -1, seconds=0.2, num_bytes=10)) is None
    assert tally.add(TransferResult("a", True, 42, seconds=0.5, num_bytes=10)) is None
    done = tally.add(TransferResult("a", True, -1, seconds=0.1, num_bytes=5))
    assert (done.ok, done.first_token, done.seconds, done.num_bytes) == (True, 42, 0.5, 25)
    assert tally.remaining == 0


def test_tally_fails_at_the_first_failed_rank():
    tally = RankTally(2)
    failed = tally.add(TransferResult("b", False, error="peer died"))
    assert not failed.ok and failed.error == "peer died"
