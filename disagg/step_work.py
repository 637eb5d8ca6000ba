"""What one engine step computed, as plain data: the one description that the engine reports,
the router's online fit and the profiler learn from, and that the simulator times.

A step runs prompt chunks (the prefill attention path) and decodes (the decode attention path:
one query row per request over its context). Which path a scheduled span takes is decided here,
once (`computes_as_decode`), for the model runner and for everything that describes its steps.

A step travels (engine -> worker -> registry -> router) as a compact list, `MeasuredStep.to_list`.
Pure Python; imports nothing of ours.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def computes_as_decode(start: int, num_new_tokens: int) -> bool:
    """Whether a span of `num_new_tokens` after `start` known tokens runs as a decode. One new
    token after at least one known token does, whether it is a sampled token or the last token of
    a prompt whose prefix was cached: the model runner batches it with the decodes (one query row
    over its context), so it also costs what a decode costs."""
    return num_new_tokens == 1 and start > 0


@dataclass(frozen=True)
class Chunk:
    """Part of a prompt computed in one step: `num_tokens` new tokens after `start` known ones."""

    start: int
    num_tokens: int

    @property
    def attention(self) -> int:
        """About twice its query-key pairs (its rows attend to s + 1 .. s + n keys): n * (2s + n);
        for a whole prompt (s = 0) DistServe's l^2 term."""
        return self.num_tokens * (2 * self.start + self.num_tokens)


def chunk_work(start: int, num_tokens: int, context_tokens: float | None) -> float:
    """A prompt chunk's compute, in tokens' worth: each token's linear layers count 1, its
    attention to c keys c / `context_tokens` (ModelConfig.attention_context_tokens; None:
    attention not counted). Deep in a long prompt a token costs several shallow ones."""
    if not context_tokens:
        return float(num_tokens)
    return num_tokens + Chunk(start, num_tokens).attention / (2 * context_tokens)


def tokens_within_work(start: int, work: float, context_tokens: float | None) -> int:
    """The most tokens after `start` whose chunk_work is at most `work` (at least 0)."""
    if work <= 0:
        return 0
    if not context_tokens:
        return int(work)
    # n + n (2s + n) / 2K <= W, the positive root of n^2 / 2K + n (1 + s / K) - W
    b = 1 + start / context_tokens
    n = int(context_tokens * (math.sqrt(b * b + 2 * work / context_tokens) - b)) + 1
    while n > 0 and chunk_work(start, n, context_tokens) > work:
        n -= 1
    return n


@dataclass(frozen=True)
class StepWork:
    """Prompt chunks and decodes of one step. A decode's context is the tokens it knows: the
    cached ones and the one computed."""

    chunks: tuple[Chunk, ...] = ()
    num_decodes: int = 0
    decode_context_sum: int = 0

    @classmethod
    def of(cls, spans: Iterable[tuple[int, int]]) -> "StepWork":
        """From each scheduled span's (start, number of new tokens); empty spans are skipped."""
        chunks, decodes, context_sum = [], 0, 0
        for start, num_new_tokens in spans:
            if computes_as_decode(start, num_new_tokens):
                decodes, context_sum = decodes + 1, context_sum + start + 1
            elif num_new_tokens > 0:
                chunks.append(Chunk(start, num_new_tokens))
        return cls(tuple(chunks), decodes, context_sum)

    @property
    def kind(self) -> str:
        """One of "prefill" (chunks only), "decode" (decodes only) or "mixed" (both); an empty
        step is a "decode" of nothing."""
        if not self.chunks:
            return "decode"
        return "mixed" if self.num_decodes else "prefill"

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.num_decodes

    @property
    def prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def prefill_attention(self) -> int:
        return sum(c.attention for c in self.chunks)


@dataclass(frozen=True)
class MeasuredStep:
    """A step's work and how long it took; `index` is the engine's step count, which tells a step
    already reported from a new one (0 where no engine counted, e.g. the profiler's)."""

    work: StepWork
    ms: float
    index: int = 0

    def with_ms(self, ms: float) -> "MeasuredStep":
        return MeasuredStep(self.work, ms, self.index)

    def to_list(self) -> list:
        """[index, ms, decodes, decode context sum, start, tokens, start, tokens, ...]: a step
        report repeats in every heartbeat, so it stays a flat list of numbers."""
        work = self.work
        spans = [n for c in work.chunks for n in (c.start, c.num_tokens)]
        return [self.index, round(self.ms, 3), work.num_decodes, work.decode_context_sum, *spans]

    @classmethod
    def from_list(cls, values: Sequence) -> "MeasuredStep":
        """The inverse of `to_list`; ValueError (or TypeError) on anything else."""
        index, ms, decodes, context_sum, *spans = values
        if len(spans) % 2:
            raise ValueError(f"step report: chunks come as (start, tokens) pairs, got {spans!r}")
        chunks = tuple(Chunk(_count(s), _count(n, least=1)) for s, n in zip(spans[::2], spans[1::2]))
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
            raise ValueError(f"step report: {ms!r} is not a duration")
        return cls(StepWork(chunks, _count(decodes), _count(context_sum)), float(ms), _count(index))


def _count(value, least: int = 0) -> int:
    """A whole number of at least `least`; a float is refused, so a report of another layout
    (durations where counts should be) does not pass for this one."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"step report: expected a count >= {least}, got {value!r}")
    return value
