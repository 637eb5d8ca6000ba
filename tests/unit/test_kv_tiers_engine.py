"""Greedy output with KV tiers equals greedy output without them, on a pool too small for the
conversations, so that their prefixes are evicted and come back from the host tier."""

from __future__ import annotations

from support import random_prompts

from disagg import LLM, SamplingParams

ENGINE = dict(
    model="random:tiny", dtype="float32", block_size=4, num_kv_blocks=24, max_model_len=128, max_num_batched_tokens=64
)


def _conversations(llm: LLM, sessions: int = 3, turns: int = 3) -> list[list[int]]:
    """Every turn's greedy answer, sessions interleaved turn by turn; each prompt is the last
    one, its answer and a new message."""
    prompts = random_prompts([20] * sessions, vocab_size=512, seed=1)
    messages = random_prompts([6] * sessions * turns, vocab_size=512, seed=2)
    answers = []
    for turn in range(turns):
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        for s, out in enumerate(outs):
            answers.append(out.outputs[0].token_ids)
            prompts[s] = prompts[s] + list(out.outputs[0].token_ids) + messages[turn * sessions + s]
    return answers


def test_greedy_output_with_tiers_equals_greedy_output_without():
    without = LLM(**ENGINE, kv_host_tier_bytes=0)
    with_tiers = LLM(**ENGINE)
    assert _conversations(with_tiers) == _conversations(without)
    stats = with_tiers.engine.kv_tiers.stats
    assert stats.hit_blocks["host"] > 0  # the pool was too small: prefixes came back from the host
    assert without.engine.kv_tiers.stats.hit_blocks["host"] == 0
