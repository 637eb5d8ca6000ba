"""The mixture-of-experts layer (disagg/engine/layers/moe.py) against a naive per-token reference
and against transformers' own routers and sparse blocks; tensor- and expert-parallel splits in
two processes over real gloo groups equal to one rank; quantized experts against their own
dequantized weights."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from disagg.engine.layers.expert_parallel import ExpertDispatch, with_keys, without_keys
from disagg.engine.layers.experts import padded_rows
from disagg.engine.layers.moe_routing import RoutingRule, route
from disagg.engine.layers.parallel import TPGroup
from support import EXPERTS, HIDDEN, INTER, TOP_K, build_moe, expert_weights, naive_moe


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("gemm", ["onednn", "torch"])
def test_layer_equals_the_per_token_reference(renormalize, gemm):
    rule = RoutingRule(EXPERTS, TOP_K, renormalize)
    weights = expert_weights()
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    moe = build_moe(rule, weights, gemm=gemm)
    out = moe(x)
    torch.testing.assert_close(out.double(), naive_moe(x, rule, weights), rtol=1e-5, atol=1e-5)
    # Each token counted once per expert it went to.
    assert int(moe.expert_tokens.sum()) == 37 * TOP_K
    assert (
        moe.expert_tokens.tolist()
        == torch.bincount(route(x @ weights[0].T, rule).expert_ids.flatten(), minlength=EXPERTS).tolist()
    )


def test_one_token_and_no_tokens():
    rule = RoutingRule(EXPERTS, TOP_K, True)
    weights = expert_weights()
    moe = build_moe(rule, weights)
    x = torch.randn(1, HIDDEN)
    torch.testing.assert_close(moe(x).double(), naive_moe(x, rule, weights), rtol=1e-5, atol=1e-5)
    assert moe(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)


def test_routers_match_transformers():
    """Qwen3-MoE: softmax, top-k, renormalised only under norm_topk_prob, weights cast back to the
    logits' dtype; Mixtral: always renormalised, float32 weights."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    x = torch.randn(20, HIDDEN, dtype=torch.bfloat16)
    for norm in (True, False):
        hf = Qwen3MoeTopKRouter(
            Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=3, norm_topk_prob=norm)
        )
        hf.weight.data = torch.randn(EXPERTS, HIDDEN).to(torch.bfloat16)
        logits, weights, ids = hf(x)
        ours = route(logits, RoutingRule(EXPERTS, 3, norm, weights_in_logits_dtype=True))
        assert torch.equal(ours.expert_ids, ids) and torch.equal(ours.weights, weights)
    hf = MixtralTopKRouter(MixtralConfig(hidden_size=HIDDEN, num_local_experts=EXPERTS, num_experts_per_tok=2))
    hf.weight.data = torch.randn(EXPERTS, HIDDEN).to(torch.bfloat16)
    logits, weights, ids = hf(x)
    ours = route(logits, RoutingRule(EXPERTS, 2, True))
    assert ours.weights.dtype == torch.float32
    assert torch.equal(ours.expert_ids, ids) and torch.equal(ours.weights, weights)


def test_layer_matches_transformers_sparse_block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
    )
    hf = Qwen3MoeSparseMoeBlock(config)
    router, gate, up, down = expert_weights(3)
    hf.gate.weight.data.copy_(router)
    hf.experts.gate_up_proj.data.copy_(torch.cat([gate, up], dim=1))
    hf.experts.down_proj.data.copy_(down)
    x = torch.randn(2, 9, HIDDEN)
    with torch.no_grad():
        expected = hf(x).view(18, HIDDEN)
    ours = build_moe(RoutingRule(EXPERTS, TOP_K, True, weights_in_logits_dtype=True), (router, gate, up, down))
    torch.testing.assert_close(ours(x.view(18, HIDDEN)), expected, rtol=1e-5, atol=1e-6)


def test_rule_and_split_are_checked():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        RoutingRule(4, 5, True)
    with pytest.raises(ValueError, match="not divisible"):
        ExpertDispatch(TPGroup(0, 3, None), 8)


def test_token_slices_cover_every_token_once():
    for n in (0, 1, 2, 5, 8):
        ranges = [ExpertDispatch(TPGroup(r, 3, None), 6).token_range(n) for r in range(3)]
        assert [t for lo, hi in ranges for t in range(lo, hi)] == list(range(n))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_experts_equal_their_dequantized_weights(fmt):
    """Each expert kept quantized computes what its own dequantized weights compute, by its
    kernel (decode rows, within a step) and by its float copy (prompt rows) alike."""
    from disagg.engine.layers.cpu_kernels import cpu_ops

    rule = RoutingRule(EXPERTS, TOP_K, True)
    weights = expert_weights(5)
    moe = build_moe(rule, weights, prepare=False)
    kernels = cpu_ops(torch.device("cpu"), "auto")
    assert moe.experts.quantize(fmt, [[None] * 3] * EXPERTS, kernels, torch.float32)
    gemms = moe.experts.gemms
    dequantized = (
        weights[0],
        torch.stack([g.dequantized()[:INTER] for g, _ in gemms]),
        torch.stack([g.dequantized()[INTER:] for g, _ in gemms]),
        torch.stack([d.dequantized() for _, d in gemms]),
    )
    assert moe.experts.gate_up_proj.numel() == 0  # the float stacks are gone
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(2))
    expected = naive_moe(x, rule, dequantized)
    out = moe(x, decode_rows=3)  # 3 decode rows then 9 prompt rows
    # The kernels quantize activations to int8 blocks: close, not exact, on the decode rows.
    torch.testing.assert_close(out[3:].double(), expected[3:], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[:3].double(), expected[:3], rtol=0.05, atol=0.02)


# ---- two processes over gloo ---------------------------------------------------------------------
def _rank_main(rank: int, store_path: str, mode: str, x: torch.Tensor, out_queue) -> None:
    try:
        torch.set_num_threads(2)  # as the parent's (conftest): the same GEMM kernels
        store = dist.FileStore(store_path, 2)  # a file, not a port another process could take
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=30)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = TPGroup(rank, 2, dist.ProcessGroupGloo(store, rank, 2, options))
        moe = build_moe(RoutingRule(EXPERTS, TOP_K, True), expert_weights(7), tp=group, expert_parallel=mode == "ep")
        with torch.no_grad():
            outs = [moe(x), moe(x[:1]), moe(x[:0])]  # many tokens; one (rank 1 dispatches none); none
        # As bytes, not tensors: a tensor crosses by a shared-memory descriptor that this process
        # must still hold when the parent reads it, and it may have exited by then.
        out_queue.put((rank, [(o.numpy().tobytes(), tuple(o.shape)) for o in outs], moe.experts.num_local_experts))
    except Exception as exc:  # the parent names it rather than waiting on a queue that stays empty
        out_queue.put((rank, repr(exc), 0))


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_two_ranks_equal_one(mode, tmp_path):
    """Expert parallel (experts split, tokens by all-to-all) and tensor parallel (each expert's
    intermediate split, all-reduce) over two processes give one rank's output; EP exactly."""
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(8))
    one = build_moe(RoutingRule(EXPERTS, TOP_K, True), expert_weights(7))
    expected = [one(x), one(x[:1]), one(x[:0])]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_rank_main, args=(r, str(tmp_path / "store"), mode, x, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict((r, (outs, local)) for r, outs, local in (queue.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=30)
    for rank in (0, 1):
        outs, local = results[rank]
        assert isinstance(outs, list), f"rank {rank} failed: {outs}"
        assert local == (EXPERTS // 2 if mode == "ep" else EXPERTS)
        for (data, shape), want in zip(outs, expected):
            got = torch.frombuffer(bytearray(data), dtype=want.dtype).view(shape) if data else torch.empty(shape)
            if mode == "ep":
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(p.exitcode == 0 for p in procs)


def test_packed_experts_run_at_few_row_counts():
    """Every row count from 1 to 2,048 maps to at most 40 padded ones, none smaller, and none
    more than a quarter larger past 16 rows (oneDNN builds a kernel per row count)."""
    padded = {n: padded_rows(n) for n in range(1, 2049)}
    assert len(set(padded.values())) <= 40
    assert all(p >= n and (n <= 16 or p <= 1.25 * n) for n, p in padded.items())
    assert [padded[n] for n in (1, 2, 3, 4, 5, 9, 17, 33, 65)] == [1, 2, 3, 4, 8, 12, 20, 40, 80]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_carry_their_keys_through_one_message(dtype):
    rows = torch.randn(5, HIDDEN).to(dtype)
    keys = torch.tensor([0, 3, 2**40 + 7, -1, 17])  # any int64 bytes, NaN patterns included
    back_rows, back_keys = without_keys(with_keys(rows, keys), HIDDEN)
    assert torch.equal(back_rows, rows) and torch.equal(back_keys, keys)
    empty_rows, empty_keys = without_keys(with_keys(rows[:0], keys[:0]), HIDDEN)
    assert empty_rows.shape == (0, HIDDEN) and empty_keys.shape == (0,)
