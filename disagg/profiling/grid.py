"""The steps `disagg profile` measures: prefill batches, decode batches and mixed chunked steps.

Sizes are fractions of the longest prompt, so that one grid serves any model and machine; each
kind is listed from small to large, so that holding out every 4th point tests the whole range.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PREFILL_BATCH = 4  # more prompts per step add little: a step's cost is its tokens and their attention


@dataclass(frozen=True)
class Grid:
    prefill: tuple[tuple[int, ...], ...]  # prompt lengths of each batch
    decode: tuple[tuple[int, int], ...]  # (batch, mean context)
    mixed: tuple[tuple[int, int, int, int], ...]  # (decodes, their mean context, chunk start, chunk tokens)

    @property
    def size(self) -> int:
        return len(self.prefill) + len(self.decode) + len(self.mixed)

    @property
    def max_batch(self) -> int:
        return max([b for b, _ in self.decode] + [d for d, *_ in self.mixed])

    @property
    def max_step_tokens(self) -> int:
        """The largest token budget a step of the grid needs."""
        return max(
            [sum(p) for p in self.prefill] + [b for b, _ in self.decode] + [d + max(s, n) for d, _, s, n in self.mixed]
        )

    @property
    def max_tokens_held(self) -> int:
        """The most KV the grid holds at once: decodes grow by a few tokens a step, contexts spread to 1.5x."""
        return max(
            [sum(p) + len(p) for p in self.prefill]
            + [b * (c * 3 // 2 + 16) for b, c in self.decode]
            + [d * (c * 3 // 2 + 16) + s + n for d, c, s, n in self.mixed]
        )


def make_grid(max_prompt_len: int, max_batch: int, quick: bool = False) -> Grid:
    if max_prompt_len < 16 or max_batch < 2:
        raise ValueError("profile grid: needs --max-prompt-len >= 16 and --max-batch >= 2")
    return Grid(
        prefill_points(max_prompt_len, min(max_batch, MAX_PREFILL_BATCH)),
        decode_points(max_prompt_len, max_batch, quick),
        mixed_points(max_prompt_len, max_batch, quick),
    )


def prefill_points(length: int, batch: int) -> tuple[tuple[int, ...], ...]:
    f = lambda *fractions: tuple(max(1, int(length * x)) for x in fractions)  # noqa: E731
    singles = [f(x) for x in (1 / 64, 1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1)]
    batches = [f(1 / 32, 1 / 8), f(1 / 8, 1 / 4), f(1 / 16, 1 / 8, 3 / 16), f(1 / 4, 1 / 2)]
    batches += [f(1 / 64, 1 / 32, 1 / 16, 1 / 8), f(1 / 8, 1 / 8, 1 / 8, 1 / 8)]
    points = singles + [b for b in batches if len(b) <= batch]
    return tuple(sorted(points, key=lambda p: (sum(p), len(p))))


def decode_points(length: int, max_batch: int, quick: bool) -> tuple[tuple[int, int], ...]:
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < max_batch} | {max_batch})
    contexts = (length // 16, length // 2) if quick else (length // 16, length // 4, length // 2, length)
    return tuple((b, max(2, c)) for b in batches for c in contexts)


def mixed_points(length: int, max_batch: int, quick: bool) -> tuple[tuple[int, int, int, int], ...]:
    """Decodes (none, few, many) with a chunk of a prompt: whole (start 0) or its later part.
    Each number of decodes takes its own three chunks of the five, so that the grid covers the
    chunks without paying for all of them at every batch."""
    chunks = [(0, length // 16), (length // 8, length // 16), (0, length // 4), (length // 4, length // 4)]
    chunks.append((length // 2, length // 8))
    with_start = [c for c in chunks if c[0] > 0]
    levels = [0, 2, max_batch // 4, max_batch] if not quick else [0, 2, max_batch]
    context = max(2, length // 4)
    points = [(0, context, s, n) for s, n in with_start]
    for i, decodes in enumerate(sorted(set(levels) - {0})):
        points += [(decodes, context, *chunks[(i + j) % len(chunks)]) for j in range(3)]
    return tuple(points)
