"""Executes one scheduled step: builds the batch tensors once, runs the model, samples.

Tokens are laid out decodes first (one per request), then each prefill chunk, so attention can
batch all decodes in one call. Only the last position of a chunk that reaches the end of its
known tokens is projected to the vocabulary and sampled.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from disagg.engine.kv_cache import KVCache
from disagg.engine.layers.attention import AttentionMetadata, PrefillSpan
from disagg.engine.sampler import Sampler
from disagg.engine.scheduler import SampledToken, ScheduledChunk, SchedulerOutput


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, sampler: Sampler, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.block_size

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, generator_of: Callable[[str], torch.Generator | None]) -> dict[str, SampledToken]:
        chunks = _decodes_first(out.chunks)
        input_ids, positions, meta = self._prepare(chunks)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        sampling = [(i, c) for i, c in enumerate(chunks) if c.samples]
        if not sampling:
            return {}
        ends = list(itertools.accumulate(c.num_new_tokens for c in chunks))
        last_rows = torch.tensor([ends[i] - 1 for i, _ in sampling], device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, last_rows))
        requests = [c.request for _, c in sampling]
        tokens, logprobs = self.sampler(logits, [r.sampling_params for r in requests], [generator_of(r.request_id) for r in requests])
        return {r.request_id: SampledToken(t, lp) for r, t, lp in zip(requests, tokens, logprobs)}

    def _prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        num_decodes = sum(1 for c in chunks if _is_decode(c))
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        for c in chunks:
            token_ids.extend(c.token_ids)
            positions.extend(range(c.start, c.start + c.num_new_tokens))
        meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode_tokens=num_decodes)
        if num_decodes:
            slots.append(self._prepare_decodes(chunks[:num_decodes], meta))
        query_start = num_decodes
        for c in chunks[num_decodes:]:
            span, span_slots = self._prepare_prefill(c, query_start)
            meta.prefills.append(span)
            slots.append(span_slots)
            query_start += c.num_new_tokens
        meta.slot_mapping = torch.cat(slots)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(token_ids), as_tensor(positions), meta

    def _prepare_decodes(self, decodes: list[ScheduledChunk], meta: AttentionMetadata) -> torch.Tensor:
        bs = self.block_size
        max_blocks = max(len(c.request.block_ids) for c in decodes)
        tables = torch.tensor([c.request.block_ids + [0] * (max_blocks - len(c.request.block_ids)) for c in decodes], dtype=torch.long, device=self.device)
        pos = torch.tensor([c.start for c in decodes], dtype=torch.long, device=self.device)
        meta.decode_block_tables = tables
        key_pos = torch.arange(max_blocks * bs, device=self.device)
        meta.decode_mask = (key_pos.unsqueeze(0) <= pos.unsqueeze(1)).view(len(decodes), 1, 1, -1)
        rows = torch.arange(len(decodes), device=self.device)
        return tables[rows, pos // bs] * bs + pos % bs

    def _prepare_prefill(self, c: ScheduledChunk, query_start: int) -> tuple[PrefillSpan, torch.Tensor]:
        bs = self.block_size
        end = c.start + c.num_new_tokens
        table = torch.tensor(c.request.block_ids[: -(-end // bs)], dtype=torch.long, device=self.device)
        pos = torch.arange(c.start, end, device=self.device)
        mask = None
        if c.start > 0:  # earlier chunks or cached prefix: attend to all of them plus causal within
            mask = torch.arange(end, device=self.device).unsqueeze(0) <= pos.unsqueeze(1)
        span = PrefillSpan(query_start, c.num_new_tokens, c.start, table, mask)
        return span, table[pos // bs] * bs + pos % bs


def _is_decode(c: ScheduledChunk) -> bool:
    return c.num_new_tokens == 1 and c.start > 0


def _decodes_first(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    return [c for c in chunks if _is_decode(c)] + [c for c in chunks if not _is_decode(c)]
