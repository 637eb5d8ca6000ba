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
TARGETS = random_prompts([6, 23, 41], VOCAB, seed=21)


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
    """`target`'s tokens and logprobs among `others`: half of them started two steps before it
    (decoding when it arrives), half arriving with it (prompt rows beside its own)."""
    engine = llm.engine
    early = others // 2
    lengths = [(7 * i + seed) % 37 + 2 for i in range(others)]
    prompts = random_prompts(lengths, VOCAB, seed=seed)
    for i, prompt in enumerate(prompts[:early]):
        engine.add_request(
            f"early-{i}", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=20, **GREEDY)
        )
    for _ in range(2 if early else 0):
        engine.step()
    engine.add_request("target", prompt_token_ids=target, sampling_params=SamplingParams(max_tokens=16, **GREEDY))
    for i, prompt in enumerate(prompts[early:]):
        engine.add_request(
            f"late-{i}", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=12, **GREEDY)
        )
    result = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "target" and out.finished:
                result = out.outputs[0]
    return [(t, lp[t]) for t, lp in zip(result.token_ids, result.logprobs)]


@pytest.mark.parametrize("others", [1, 3, 7, 31])
def test_a_greedy_request_is_computed_alike_alone_and_among_others(llm, others):
    for n, target in enumerate(TARGETS):
        alone = _run(llm, target, 0, seed=0)
        assert _run(llm, target, others, seed=n + others) == alone, f"target {n} among {others}"
