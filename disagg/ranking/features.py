"""What the length ranker sees of a prompt: features that cost microseconds, no model call.

A hashed bag of the prompt's token ids and of its adjacent pairs (bigrams: "Write an", "one
word"), counted into a fixed number of buckets and scaled to unit length, plus the log of the
prompt's length. The bag tells what kind of answer is asked for; the length, how much there is
to answer about. Hashing keeps the size fixed whatever the tokenizer's vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_NUM_BUCKETS = 2048
# Odd multipliers of a multiplicative hash (Knuth's): neighbouring ids land far apart, and a
# bigram's two ids are mixed with different multipliers so that (a, b) and (b, a) differ.
_UNIGRAM_MULT = 2654435761
_BIGRAM_MULT_FIRST = 2246822519
_BIGRAM_MULT_SECOND = 3266489917
_MASK = (1 << 32) - 1
LENGTH_SCALE = 1 / 8  # log(prompt length) is ~3 to 8: scaled to the bag's order of magnitude


def num_features(num_buckets: int) -> int:
    return num_buckets + 1  # the buckets, then the log length


def _buckets(token_ids: np.ndarray, num_buckets: int) -> np.ndarray:
    """The bucket of every token and of every adjacent pair."""
    ids = token_ids.astype(np.uint64)
    unigrams = (ids * _UNIGRAM_MULT) & _MASK
    bigrams = ((ids[:-1] * _BIGRAM_MULT_FIRST) ^ (ids[1:] * _BIGRAM_MULT_SECOND)) & _MASK
    hashed = np.concatenate([unigrams, bigrams]) >> np.uint64(7)  # the low bits of a product mix least
    return (hashed % np.uint64(num_buckets)).astype(np.int64)


def prompt_features(token_ids: Sequence[int], num_buckets: int = DEFAULT_NUM_BUCKETS) -> np.ndarray:
    """A float32 vector of `num_features(num_buckets)`: the unit-length hashed bag, then
    log(1 + prompt length) * LENGTH_SCALE."""
    ids = np.asarray(token_ids, dtype=np.int64)
    features = np.zeros(num_features(num_buckets), dtype=np.float32)
    if ids.size:
        counts = np.bincount(_buckets(ids, num_buckets), minlength=num_buckets).astype(np.float32)
        features[:num_buckets] = counts / np.linalg.norm(counts)
    features[num_buckets] = np.log1p(ids.size) * LENGTH_SCALE
    return features


def feature_matrix(prompts: Sequence[Sequence[int]], num_buckets: int = DEFAULT_NUM_BUCKETS) -> np.ndarray:
    """One row of `prompt_features` per prompt."""
    if not prompts:
        return np.zeros((0, num_features(num_buckets)), np.float32)
    return np.stack([prompt_features(p, num_buckets) for p in prompts])
