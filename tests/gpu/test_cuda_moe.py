"""Mixture of experts on CUDA: the layer against its per-token reference (float32 and bfloat16),
and Qwen3-MoE and Mixtral engines decoding what the CPU engine decodes (greedy, float32). Expert
parallelism over NCCL needs two GPUs; these need one."""

from __future__ import annotations

import pytest
import torch
from support import EXPERTS, HIDDEN, TOP_K, build_moe, describe_mismatches, expert_weights, naive_moe, random_prompts

from disagg import LLM, SamplingParams
from disagg.engine.layers.moe_routing import RoutingRule

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def _exact_float32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_layer_on_cuda_equals_the_reference(dtype, tolerance):
    rule = RoutingRule(EXPERTS, TOP_K, True)
    weights = expert_weights()
    with torch.device("cuda"):
        moe = build_moe(rule, weights).to(dtype)
        x = torch.randn(33, HIDDEN, generator=torch.Generator("cuda").manual_seed(1), dtype=dtype)
        out = moe(x)
    expected = naive_moe(x.float().cpu(), rule, weights)
    torch.testing.assert_close(out.double().cpu(), expected, rtol=tolerance, atol=tolerance)
    assert int(moe.expert_tokens.sum()) == 33 * TOP_K


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_cuda_engine_decodes_what_the_cpu_engine_decodes(request, kind):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    prompts = random_prompts([1, 7, 33, 90], 512, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model=model_dir, dtype="float32", device=device, num_kv_blocks=64, max_num_batched_tokens=32)
        assert llm.engine.runner.decode_graphs is None  # a MoE step reads counts back: no graphs
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outputs[device] = [list(o.outputs[0].token_ids) for o in outs]
    assert outputs["cuda"] == outputs["cpu"], describe_mismatches(prompts, outputs["cpu"], outputs["cuda"])
