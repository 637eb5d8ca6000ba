"""With the default settings (4-bit weights, batch_invariant off), a greedy request's tokens and
their logprobs, to the last bit, do not depend on what else its steps hold: alone, or beside
1, 3, 7 or 31 others, some of them decoding and some computing their prompts in the same steps
(a prompt's rows take the float32 copy whatever their number, a decode's row the quantized
kernel however many decode, the vocabulary's rows their kernel by kind: layers/quantized.py)."""

from __future__ import annotations

import pytest
import torch
from support import random_prompts

from disagg import LLM, SamplingParams
from disagg.engine.layers.cpu_kernels import cpu_ops
from disagg.engine.layers.quantized import Int4Weight

VOCAB = 256
GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=0)
TARGETS = random_prompts([6, 41, 150], VOCAB, seed=21)


@pytest.fixture
def ops():
    ops = cpu_ops(torch.device("cpu"), "auto")
    if ops is None:
        pytest.skip("the C++ CPU kernels did not build here")
    return ops


def test_a_row_gets_the_same_bits_among_any_number_of_rows_of_its_kind(ops):
    """A decode's row takes the quantized kernel among up to 40 decodes (not only up to 4), a
    prompt's row the float copy among 1 to 300 prompt rows, with the same bits each time."""
    torch.manual_seed(3)
    weight = Int4Weight(torch.randn(192, 576) * 0.05, kernels=ops)
    if weight._wide is None:
        pytest.skip("no float copy here (oneDNN off): one path only")
    rows = torch.randn(300, 576)
    decode = weight._narrow(rows[:1])
    for n in (1, 2, 5, 8, 9, 32, 40):
        assert torch.equal(weight.linear(rows[:n], decode_rows=n)[:1], decode), f"among {n} decodes"
        assert torch.equal(weight.silu_mul(rows[:n], decode_rows=n)[:1], weight.silu_mul(rows[:1], decode_rows=1))
    prompt = weight._wide_product(rows[:1])
    for n in (2, 3, 17, 64, 129, 300):
        assert torch.equal(weight.linear(rows[:n], decode_rows=0)[:1], prompt), f"among {n} prompt rows"
        assert torch.equal(weight.linear(rows[:n], decode_rows=0)[n - 1 :], weight._wide_product(rows[n - 1 : n]))


@pytest.fixture(scope="module")
def llm(tiny_gqa_dir):
    if cpu_ops(torch.device("cpu"), "auto") is None:
        pytest.skip("the C++ CPU kernels did not build here")
    return LLM(model=tiny_gqa_dir, weights="int4", num_kv_blocks=512, enable_prefix_caching=False)


def _run(llm, target: list[int], others: int, seed: int) -> list[tuple[int, float]]:
    """`target`'s tokens and logprobs among `others`: a third of them started two steps before it
    (decoding when it arrives), a third arriving just before it (its prompt then gets what of the
    step's budget they leave: it may be cut into chunks otherwise than alone), a third after."""
    engine = llm.engine
    lengths = [(7 * i + seed) % 37 + 2 for i in range(others)]
    prompts = random_prompts(lengths, VOCAB, seed=seed)
    early, before = prompts[: others // 3], prompts[others // 3 : 2 * others // 3]
    _add(engine, "early", early, max_tokens=20)
    for _ in range(2 if early else 0):
        engine.step()
    _add(engine, "before", before, max_tokens=12)
    _add(engine, "target", [target], max_tokens=16)
    _add(engine, "after", prompts[2 * others // 3 :], max_tokens=12)
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "target-0" and out.finished:
                result = out.outputs[0]
    return [(t, lp[t]) for t, lp in zip(result.token_ids, result.logprobs)]


def _add(engine, name: str, prompts: list[list[int]], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{i}", prompt_token_ids=prompt, sampling_params=params)


@pytest.mark.parametrize("others", [1, 3, 7, 31])
def test_a_greedy_request_is_computed_alike_alone_and_among_others(llm, others):
    for n, target in enumerate(TARGETS):
        alone = _run(llm, target, 0, seed=0)
        assert _run(llm, target, others, seed=n + others) == alone, f"target {n} among {others}"


def test_a_prompt_in_chunks_and_whole_gives_the_same_numbers(tiny_gqa_dir, ops):
    """However a step's budget cuts a prompt (chunks of 16 or 50, each attending to the cached
    ones before it, or whole), the same logprobs to the last bit: past 512 keys too."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([40, 77, 300, 700], VOCAB, seed=12)]
    params = SamplingParams(max_tokens=4, **GREEDY)

    def run(budget: int):
        chunked = LLM(model=tiny_gqa_dir, weights="int4", num_kv_blocks=512, max_num_batched_tokens=budget,
                  enable_prefix_caching=False)  # fmt: skip
        outs = chunked.generate(prompts, params, use_tqdm=False)
        return [[(t, lp[t]) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]

    whole = run(1024)
    assert run(16) == whole
    assert run(50) == whole


@pytest.mark.slow
def test_the_default_model_answers_alike_alone_and_among_seven(ops):
    """The default model (SmolLM2-135M's Q4_1 GGUF): the capital-of-France answer, and its tokens'
    logprobs, the same alone and beside 7 other requests (decoding, and prompts in its steps)."""
    llm = LLM(num_kv_blocks=256, enable_prefix_caching=False, weights="auto")  # the tests' default is fp32
    tokenizer = llm.tokenizer
    target = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    alone = _run(llm, target, 0, seed=0)
    assert "Paris" in tokenizer.decode([t for t, _ in alone])
    assert _run(llm, target, 7, seed=5) == alone
