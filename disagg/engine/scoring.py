"""Scoring a text with the engine's own model: each token's log-probability, and perplexity.

This is how the quantized compute is checked against llama.cpp: `perplexity` follows
`llama-perplexity` (the text cut into windows of `context` tokens, each run from an empty cache,
only the tokens of each window's second half scored, so that each has at least half a window
of context), so the two numbers are comparable on the same GGUF and text.

A window runs either as one prefill step (the prefill kernels) or in steps of `step_tokens`
positions: steps of 1 run the decode path, as a generated token's decode (its attention
kernel, and a quantized model's int8-activation kernels), so both paths can be checked.
Scoring runs on the caller's thread: call it on an engine that is not serving.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from disagg.engine.scheduler import ScheduledChunk
from disagg.request import Request, SamplingParams

_ids = itertools.count()


def next_token_logprobs(engine, token_ids: list[int], step_tokens: int | None = None) -> torch.Tensor:
    """log P(token_ids[i+1] | token_ids[:i+1]) for every i: len(token_ids) - 1 values."""
    if len(token_ids) < 2:
        raise ValueError("scoring needs at least 2 tokens")
    if len(token_ids) > engine.max_model_len:
        raise ValueError(f"{len(token_ids)} tokens exceed the model's length {engine.max_model_len}")
    step = step_tokens or len(token_ids)
    request = Request(f"score-{next(_ids)}", list(token_ids), SamplingParams(max_tokens=1))
    if not engine.block_manager.allocate_slots(request, len(token_ids)):
        raise ValueError("not enough free KV blocks to score this many tokens")
    try:
        logits = [_window_logits(engine, request, start, step) for start in range(0, len(token_ids), step)]
    finally:
        engine.block_manager.free(request)
    logprobs = torch.cat(logits)[:-1].log_softmax(dim=-1)
    return logprobs.gather(1, torch.tensor(token_ids[1:]).unsqueeze(1)).squeeze(1)


def _window_logits(engine, request: Request, start: int, step: int) -> torch.Tensor:
    chunk = ScheduledChunk(request, start, min(step, request.num_tokens - start))
    chunk.generates = step == 1  # scored as a generated token's decode is computed (its kernels)
    return engine.runner.logits_at_every_position(chunk).cpu()


@dataclass(frozen=True)
class Perplexity:
    value: float
    stderr: float  # of the value, as llama-perplexity reports it
    num_windows: int
    num_scored: int


def perplexity(engine, token_ids: list[int], context: int = 512, step_tokens: int | None = None) -> Perplexity:
    """llama-perplexity's estimate: windows of `context` tokens, the second half of each scored."""
    num_windows = len(token_ids) // context
    if num_windows < 1:
        raise ValueError(f"need at least {context} tokens, got {len(token_ids)}")
    first = context // 2
    nll = []
    for w in range(num_windows):
        window = token_ids[w * context : (w + 1) * context]
        # Position j's logits predict token j+1: positions first .. context-2 are scored.
        nll.extend((-next_token_logprobs(engine, window, step_tokens)[first:]).tolist())
    mean = sum(nll) / len(nll)
    variance = sum(x * x for x in nll) / len(nll) - mean * mean
    value = math.exp(mean)
    stderr = value * math.sqrt(max(variance, 0.0) / (len(nll) - 1)) if len(nll) > 1 else 0.0
    return Perplexity(value, stderr, num_windows, len(nll))
