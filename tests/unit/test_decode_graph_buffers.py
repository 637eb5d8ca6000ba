"""The static-buffer path of CUDA-graph decode (disagg/engine/cuda_graphs.py) on CPU: steps copied
into fixed buffers and padded with copies of the first decode give exactly the eager engine's
tokens and leave the cache as eager steps do. Only the capture needs CUDA (tests/gpu); here the
"graph" of each size is the same forward called directly."""

from __future__ import annotations

import pytest
import torch
from support import describe_mismatches, random_prompts

from disagg import LLM, SamplingParams
from disagg.engine.cuda_graphs import DecodeGraphs
from disagg.engine.layers.attention import select_decode_kernel

PROMPT_LENGTHS = [3, 9, 17, 40, 64, 100, 5]  # 7 requests: padded to 8, then 4, 2, 1


class _DirectCall:
    def __init__(self, graphs: DecodeGraphs, size: int):
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs._forward(self.size)


class UncapturedGraphs(DecodeGraphs):
    @torch.inference_mode()
    def capture(self) -> None:
        self._graphs = {size: _DirectCall(self, size) for size in self.sizes}


def _generate(llm: LLM) -> list[list[int]]:
    prompts = random_prompts(PROMPT_LENGTHS, 256, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_padded_static_buffers_decode_as_eager(tiny_gqa_dir):
    kernel = select_decode_kernel(torch.device("cpu"), "auto")
    if kernel is None:
        pytest.skip("the CPU decode kernel is not built (the torch path sizes its buckets on the host)")
    engine_args = dict(model=tiny_gqa_dir, device="cpu", dtype="float32", max_num_seqs=8, num_kv_blocks=128)
    eager = _generate(LLM(**engine_args))
    llm = LLM(**engine_args)
    engine = llm.engine
    graphs = UncapturedGraphs(engine.model, engine.kv_cache, kernel, engine.device, max_batch=8, max_blocks_per_seq=64)
    graphs.capture()
    engine.runner.decode_graphs = graphs
    replayed = _generate(llm)
    assert graphs.replays >= 10
    assert replayed == eager, describe_mismatches(random_prompts(PROMPT_LENGTHS, 256, seed=5), eager, replayed)
