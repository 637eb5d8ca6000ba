"""The engine on CUDA decodes exactly what the CPU engine decodes (greedy, float32), on the tiny
checkpoints of every supported shape and on the default model; and a prefill cache on CUDA is
exported for peers (CUDA IPC) while a decode cache is not."""

from __future__ import annotations

import pytest
import torch
from support import default_gguf_location, describe_mismatches, random_prompts

from disagg import LLM, SamplingParams
from disagg.config import DEFAULT_MODEL
from disagg.engine.kv_cache import KVCache
from disagg.kv_transfer.shared_memory import attach

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TINY_KINDS = ["llama", "gqa", "untied", "qwen2_bias"]
PROMPT_LENGTHS = [1, 7, 16, 17, 64, 129, 400]
MAX_TOKENS = 20


@pytest.fixture(autouse=True)
def _exact_float32():
    """TF32 would round float32 matmuls to 10-bit mantissas: not the CPU's arithmetic."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _greedy_tokens(model: str, device: str, prompts, max_tokens: int, **engine_args) -> list[list[int]]:
    llm = LLM(model=model, device=device, dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("budget", [512, 64])
@pytest.mark.parametrize("kind", TINY_KINDS)
def test_cuda_equals_cpu_on_tiny_checkpoints(request, kind, budget):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    prompts = random_prompts(PROMPT_LENGTHS, 512, seed=7)
    engine_args = dict(max_num_batched_tokens=budget, num_kv_blocks=256)
    cpu = _greedy_tokens(model_dir, "cpu", prompts, MAX_TOKENS, **engine_args)
    cuda = _greedy_tokens(model_dir, "cuda", prompts, MAX_TOKENS, **engine_args)
    assert cuda == cpu, f"{kind}, budget {budget}:\n" + describe_mismatches(prompts, cpu, cuda)


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "qwen3", "gemma3"])
def test_cuda_equals_cpu_on_the_new_families(family_dir, kind):
    """Sliding windows (32 and 48 tokens) through the Triton decode kernel and chunked prefills."""
    prompts = random_prompts(PROMPT_LENGTHS, 512, seed=7)
    engine_args = dict(max_num_batched_tokens=64, num_kv_blocks=256)
    cpu = _greedy_tokens(family_dir(kind), "cpu", prompts, MAX_TOKENS, **engine_args)
    cuda = _greedy_tokens(family_dir(kind), "cuda", prompts, MAX_TOKENS, **engine_args)
    assert cuda == cpu, f"{kind}:\n" + describe_mismatches(prompts, cpu, cuda)


@pytest.mark.slow
def test_cuda_equals_cpu_on_the_default_model():
    try:
        default_gguf_location()
    except RuntimeError as exc:  # not installed here (a GPU machine gets it from deploy/gpu/prepare.sh)
        pytest.skip(str(exc))
    llm = LLM(model=DEFAULT_MODEL, device="cpu", dtype="float32")
    tokenizer = llm.engine.tokenizer
    questions = ["What is the capital of France?", "Name three primary colours.", "Write a haiku about rain."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    cpu = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    del llm
    cuda_llm = LLM(model=DEFAULT_MODEL, device="cuda", dtype="float32")
    outs = cuda_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    cuda = [list(o.outputs[0].token_ids) for o in outs]
    assert cuda == cpu, describe_mismatches(prompts, cpu, cuda)
    assert "Paris" in outs[0].outputs[0].text


def test_a_prefill_cache_on_cuda_is_exported_and_maps_back():
    cache = KVCache(2, 8, 4, 2, 16, torch.bfloat16, torch.device("cuda"), shared=True)
    assert cache.shared_handle is not None
    cache.tensor.normal_()
    mapped = attach(cache.shared_handle, tuple(cache.tensor.shape), torch.bfloat16)  # in-process: the tensor itself
    assert mapped.data_ptr() == cache.tensor.data_ptr()
    assert KVCache(2, 8, 4, 2, 16, torch.bfloat16, torch.device("cuda")).shared_handle is None
