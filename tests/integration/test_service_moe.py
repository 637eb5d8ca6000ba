"""A mixture of experts through the disaggregated service: a prefill pool of TP2 with expert
parallelism (attention split by heads, experts split over the two ranks, tokens by all-to-all)
streaming its KV, resharded by heads, to a decode pool of one worker. Greedy output equals the
offline engine's, the per-expert load reaches the frontend's metrics, and every block is free.
Mixtral the other way round: expert parallelism on the decode side."""

from __future__ import annotations

import dataclasses
import time
import urllib.request

from test_service_parallel import assert_all_blocks_free, config, offline_tokens, served_tokens

from disagg.server import Server


def expert_series(url: str) -> list[str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return [line for line in text.splitlines() if line.startswith("disagg:moe_expert_tokens_total{")]


def test_prefill_ep2_to_decode_tp1(ray_session, tiny_qwen3_moe_dir):
    expected = offline_tokens(tiny_qwen3_moe_dir)
    pools = {"prefill": {"tensor_parallel_size": 2, "enable_expert_parallel": True}, "decode": {}}
    cfg = dataclasses.replace(config(tiny_qwen3_moe_dir, pools, "disaggregated"), metrics_port=0)
    with Server(cfg) as server:
        assert served_tokens(server) == expected
        assert_all_blocks_free(server)
        plans = {
            i.role: (i.view.info.tensor_parallel_size, i.view.info.expert_parallel_size) for i in server.directory.all()
        }
        assert plans == {"prefill": (2, 2), "decode": (1, 1)}
        deadline = time.monotonic() + 10  # heartbeats, then the frontend's gauge refresh (1 s each)
        while len(series := expert_series(server.metrics_url)) < 16:
            assert time.monotonic() < deadline, f"per-expert load not exposed: {series}"
            time.sleep(0.5)
        assert {'role="prefill"' in line for line in series} == {True, False}  # 8 experts of each instance


def test_mixtral_prefill_tp1_to_decode_ep2(ray_session, tiny_mixtral_dir):
    """Mixtral's routing (top-k of the logits, then softmax over the k), with expert parallelism on
    the decode side this time."""
    expected = offline_tokens(tiny_mixtral_dir)
    pools = {"prefill": {}, "decode": {"tensor_parallel_size": 2, "enable_expert_parallel": True}}
    with Server(config(tiny_mixtral_dir, pools, "disaggregated")) as server:
        assert served_tokens(server) == expected
        assert_all_blocks_free(server)
