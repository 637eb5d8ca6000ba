"""Decode steps replayed from CUDA graphs produce exactly the eager engine's tokens, over batches
that shrink through every captured size and through padded ones; and they did replay."""

from __future__ import annotations

import pytest
import torch
from support import describe_mismatches, random_prompts

from disagg import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPT_LENGTHS = [3, 9, 17, 40, 64, 100, 130, 200, 257, 300, 5]  # 11 requests: padded to 16


@pytest.fixture(autouse=True)
def _exact_float32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _run(model_dir: str, enforce_eager: bool) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=model_dir, device="cuda", dtype="float32", max_num_seqs=16, num_kv_blocks=512,
              enforce_eager=enforce_eager)  # fmt: skip
    prompts = random_prompts(PROMPT_LENGTHS, 512, seed=3)
    # Different lengths, so the batch shrinks one request at a time through sizes 11..1.
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.parametrize("kind", ["llama", "gqa"])
def test_graph_replay_equals_eager(request, kind):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    eager, eager_llm = _run(model_dir, enforce_eager=True)
    assert eager_llm.engine.runner.decode_graphs is None
    graphed, llm = _run(model_dir, enforce_eager=False)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16]
    assert graphs.replays >= 20  # most decode steps ran from a graph
    prompts = random_prompts(PROMPT_LENGTHS, 512, seed=3)
    assert graphed == eager, describe_mismatches(prompts, eager, graphed)


@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_graph_replay_equals_eager_with_sliding_windows(family_dir, kind):
    """Each layer's window is a constant of its kernel call, captured with the graph: prompts
    many 32-token windows long decode the same replayed as eagerly."""
    model_dir = family_dir(kind)
    eager, _ = _run(model_dir, enforce_eager=True)
    graphed, llm = _run(model_dir, enforce_eager=False)
    assert llm.engine.runner.decode_graphs.replays >= 20
    assert graphed == eager, describe_mismatches(random_prompts(PROMPT_LENGTHS, 512, seed=3), eager, graphed)
