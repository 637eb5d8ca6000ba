"""Structured output inside an engine: each constrained request's grammar state masks the logits
of every token the request samples, and appends the tokens its grammar forces (jump-forward).

The state is a function of the grammar and the tokens generated so far, so it moves with no
transfer of its own: wherever a request samples (a prefill instance its first token, a decode
instance the rest, another instance after a migration or a recovery) the matcher is made from
the grammar the request carries and caught up on its generated tokens, microseconds a token,
as the request's KV arrives with its blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import llguidance
import torch

from disagg.engine.grammar import GrammarCompiler
from disagg.request import Request

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarError(RuntimeError):
    """A request's tokens left its grammar (tokens it resumed with, or a grammar that errs)."""


@dataclass
class _Guide:
    matcher: llguidance.LLMatcher
    consumed: int = 0  # the request's generated tokens the matcher has taken


class GuidedDecoding:
    """The grammar state of an engine's structured requests (engine thread only)."""

    def __init__(self, compiler: Callable[[], GrammarCompiler], jump_forward: bool = True):
        self._compiler = compiler  # built on first use: it costs ~0.5 s per tokenizer
        self.jump_forward = jump_forward

    def mask(self, requests: list[Request], logits: torch.Tensor) -> None:
        """Make the tokens each structured request's grammar forbids impossible (-inf), in place.
        Row i of `logits` is the token requests[i] samples now."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.structured is not None]
        if not rows:
            return
        # One bit per token, 32 to an int32 (llguidance's layout). Not llguidance.torch's helpers:
        # importing that module compiles a kernel with torch.compile, 3 s in every process.
        bitmask = torch.empty((len(rows), (logits.shape[1] + 31) // 32), dtype=torch.int32)
        row_bytes = bitmask.shape[1] * bitmask.element_size()
        for j, i in enumerate(rows):
            matcher = self._caught_up(requests[i]).matcher
            matcher.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), row_bytes)
        allowed = _unpack(bitmask, logits.shape[1]).to(logits.device)
        index = torch.tensor(rows, device=logits.device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))

    def advance(self, request: Request, token_id: int) -> tuple[list[int], bool]:
        """The request sampled `token_id` (not yet appended): the tokens its grammar forces next,
        to append after it, and whether the grammar is complete (nothing may follow)."""
        guide = self._caught_up(request)
        if not guide.matcher.consume_token(token_id):
            raise GrammarError(f"token {token_id} breaks the grammar: {guide.matcher.get_error()}")
        guide.consumed += 1
        forced: list[int] = []
        if self.jump_forward and request.sampling_params.jumps_forward and not guide.matcher.is_stopped():
            forced = list(guide.matcher.compute_ff_tokens())
            if forced and not guide.matcher.consume_tokens(forced):
                raise GrammarError(f"its forced tokens break the grammar: {guide.matcher.get_error()}")
            guide.consumed += len(forced)
        return forced, guide.matcher.is_stopped()

    def _caught_up(self, request: Request) -> _Guide:
        """The request's grammar state (held by the request), caught up with its tokens."""
        guide = request.guide
        if guide is None:
            guide = request.guide = _Guide(self._compiler().matcher(request.sampling_params.structured))
        new = generated_tokens(request, guide.consumed)
        if new and not guide.matcher.consume_tokens(new):
            raise GrammarError(f"its generated tokens break the grammar: {guide.matcher.get_error()}")
        guide.consumed += len(new)
        if guide.matcher.is_error():
            raise GrammarError(guide.matcher.get_error())
        return guide


def generated_tokens(request: Request, start: int = 0) -> list[int]:
    """The request's generated tokens from the `start`-th on: those it resumed with (the tail of
    its prompt after a migration or a recovery), then its outputs here."""
    resumed = request.sampling_params.resumed_tokens
    prompt = request.prompt_token_ids
    head = prompt[len(prompt) - resumed + start :] if start < resumed else []
    return head + request.output_token_ids[max(0, start - resumed) :]


def _unpack(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, words] int32 bit sets -> [rows, width] bool (token t is bit t % 32 of word t // 32)."""
    bits = (bitmask.unsqueeze(-1) >> _BIT_SHIFTS) & 1
    return bits.view(bitmask.shape[0], -1)[:, :width].bool()
