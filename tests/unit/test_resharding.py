"""KV resharding between prefill and decode parallel plans: pure mapping, then data movement."""

from __future__ import annotations

import itertools

import pytest
import torch

from disagg.engine.partition import head_range, layer_range
from disagg.kv_transfer.resharding import KVRoute, ParallelPlan, plan_kv_routes

LAYERS, HEADS = 6, 4


def full_cache(seed: int = 0) -> torch.Tensor:
    """A whole model's KV for a few blocks: [layers, 2, heads, blocks, block_size, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, HEADS, 3, 4, 8, generator=g)


def shard(cache: torch.Tensor, plan: ParallelPlan, rank: tuple[int, int]) -> torch.Tensor:
    """The part of the full cache one rank of a plan holds."""
    (l0, l1), (h0, h1) = layer_range(LAYERS, rank[1], plan.pp), head_range(HEADS, rank[0], plan.tp)
    return cache[l0:l1, :, h0:h1].clone()


def move(routes: list[KVRoute], src_shards: dict, dst_shards: dict) -> None:
    for r in routes:
        (sl, sh), (dl, dh) = r.src_local(), r.dst_local()
        dst_shards[r.dst][dl, :, dh] = src_shards[r.src][sl, :, sh]


PLANS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 3)]


@pytest.mark.parametrize("src,dst", list(itertools.product(PLANS, PLANS)))
def test_routes_cover_every_decode_slice_exactly_once(src, dst):
    src_plan, dst_plan = ParallelPlan(*src), ParallelPlan(*dst)
    routes = plan_kv_routes(LAYERS, HEADS, src_plan, dst_plan)
    coverage = {rank: torch.zeros(LAYERS, HEADS, dtype=torch.int) for rank in dst_plan.ranks()}
    for r in routes:
        coverage[r.dst][r.layers[0] : r.layers[1], r.heads[0] : r.heads[1]] += 1
    for (tp, pp), cov in coverage.items():
        (l0, l1), (h0, h1) = layer_range(LAYERS, pp, dst_plan.pp), head_range(HEADS, tp, dst_plan.tp)
        expected = torch.zeros(LAYERS, HEADS, dtype=torch.int)
        expected[l0:l1, h0:h1] = 1
        assert torch.equal(cov, expected), f"decode rank {(tp, pp)}"


@pytest.mark.parametrize("src,dst", [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 2), (1, 1)), ((2, 2), (1, 3))])
def test_moving_data_along_routes_reassembles_each_decode_shard(src, dst):
    src_plan, dst_plan = ParallelPlan(*src), ParallelPlan(*dst)
    cache = full_cache()
    src_shards = {rank: shard(cache, src_plan, rank) for rank in src_plan.ranks()}
    dst_shards = {rank: torch.full_like(shard(cache, dst_plan, rank), float("nan")) for rank in dst_plan.ranks()}
    move(plan_kv_routes(LAYERS, HEADS, src_plan, dst_plan), src_shards, dst_shards)
    for rank, got in dst_shards.items():
        assert torch.equal(got, shard(cache, dst_plan, rank)), f"decode rank {rank}"


def test_tp2_to_tp1_sends_each_half_of_the_heads():
    routes = plan_kv_routes(LAYERS, HEADS, ParallelPlan(tp=2), ParallelPlan(tp=1))
    assert [(r.src, r.dst, r.heads, r.layers) for r in routes] == [
        ((0, 0), (0, 0), (0, 2), (0, 6)),
        ((1, 0), (0, 0), (2, 4), (0, 6)),
    ]
    assert routes[1].dst_local() == (slice(0, 6), slice(2, 4)) and routes[1].src_local() == (slice(0, 6), slice(0, 2))


def test_pp2_to_pp1_sends_each_stage_its_layers():
    routes = plan_kv_routes(LAYERS, HEADS, ParallelPlan(pp=2), ParallelPlan(pp=1))
    assert [(r.src, r.layers) for r in routes] == [((0, 0), (0, 3)), ((0, 1), (3, 6))]
    assert routes[1].src_local()[0] == slice(0, 3) and routes[1].dst_local()[0] == slice(3, 6)


def test_indivisible_heads_rejected():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        plan_kv_routes(LAYERS, 3, ParallelPlan(tp=2), ParallelPlan())
