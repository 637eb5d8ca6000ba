"""Turns the logits of a step into tokens: greedy, temperature, top-k, top-p, per-request seeds.

Vectorized over the batch. Per-request seeds need per-request generators, so only the rows
with a seed draw their noise one by one. Sampling uses the exponential race (argmax of
p / Exp(1) noise), which is equivalent to a multinomial draw and needs no cumulative sums.
"""

from __future__ import annotations

import torch

from disagg.request import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0):
        self._default_generator: torch.Generator | None = None
        self._seed = seed

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        raw_logits: torch.Tensor | None = None,
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: [N, vocab] float32. Returns the chosen token per row and, where asked, logprobs
        (of `raw_logits` when given: the model's before a grammar masked them)."""
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy_rows) == len(params):  # every row greedy (a step's usual case): no gather
            token_list = logits.argmax(dim=-1).tolist()
            return token_list, self._logprobs(logits if raw_logits is None else raw_logits, params, token_list)
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        if greedy_rows:
            index = torch.tensor(greedy_rows, device=logits.device)
            tokens[index] = logits.index_select(0, index).argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            probs = self._filtered_probs(logits.index_select(0, index), [params[i] for i in random_rows])
            noise = self._exponential_noise(probs, [generators[i] for i in random_rows])
            tokens[index] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        return token_list, self._logprobs(logits if raw_logits is None else raw_logits, params, token_list)

    def _filtered_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        logits = logits / temps.unsqueeze(1)
        # top_k beyond the vocabulary keeps every token (an offline caller's, unchecked against the model)
        top_ks = [min(p.top_k, logits.shape[1]) if p.top_k > 0 else logits.shape[1] for p in params]
        if min(top_ks) < logits.shape[1]:
            logits = _apply_top_k(logits, torch.tensor(top_ks, device=logits.device))
        top_ps = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
        probs = logits.softmax(dim=-1)
        if (top_ps < 1).any():
            probs = _apply_top_p(probs, top_ps)
        return probs

    def _exponential_noise(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            rows = noise[unseeded].exponential_(generator=self._generator(probs.device))
            noise[unseeded] = rows
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        return noise

    def _generator(self, device: torch.device) -> torch.Generator:
        if self._default_generator is None:
            self._default_generator = torch.Generator(device=device).manual_seed(self._seed)
        return self._default_generator

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
    ) -> list[dict[int, float] | None]:
        """Log-probabilities of the raw model distribution (before temperature/top-k/top-p), like vLLM."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[dict[int, float] | None] = [None] * len(params)
        if not rows:
            return result
        logprobs = logits[rows].log_softmax(dim=-1)
        for j, i in enumerate(rows):
            entry = {tokens[i]: logprobs[j, tokens[i]].item()}
            if params[i].logprobs:
                top = logprobs[j].topk(params[i].logprobs)
                entry.update(zip(top.indices.tolist(), top.values.tolist()))
            result[i] = entry
        return result


_MASK64 = (1 << 64) - 1


def token_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    """The generator of a seeded request's `index`-th output token: a function of (seed, index)
    alone, not of the tokens drawn before, so that the stream is the same wherever each token is
    sampled (a prefill instance the first, a decode instance the rest, another one after a
    migration). The pair is mixed by SplitMix64 so that nearby seeds give unrelated streams."""
    if seed is None:
        return None
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return torch.Generator(device=device).manual_seed((z ^ (z >> 31)) >> 1)


def _apply_top_k(logits: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth = sorted_logits.gather(1, (top_ks - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    # Keep the smallest set whose mass reaches top_p: drop a token if the mass before it already does.
    drop_sorted = (cumulative - sorted_probs) >= top_ps.unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)
