"""Executes one scheduled step: builds the batch tensors once, runs the model, samples.

Tokens are laid out decodes first (one per request), then each prefill chunk, so attention can
batch all decodes in one call. Only the last position of a chunk that reaches the end of its
known tokens is projected to the vocabulary and sampled.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from disagg.engine.cuda_graphs import DecodeGraphs
from disagg.engine.distributed import PipelineLink
from disagg.engine.kv_cache import KVCache
from disagg.engine.kv_connector import Followers, KVConnector
from disagg.engine.layers.attention import AttentionMetadata, DecodeBatch, PrefillSpan
from disagg.engine.layers.cpu_kernels import DecodeKernel
from disagg.engine.sampler import Sampler
from disagg.engine.scheduler import SampledToken, ScheduledChunk, SchedulerOutput
from disagg.request import Request
from disagg.step_work import computes_as_decode


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        sampler: Sampler,
        device: torch.device,
        *,
        decode_kernel: DecodeKernel | None = None,
        kv_connector: KVConnector | None = None,
        pipe: PipelineLink | None = None,
        returns_logits: bool = True,
        followers: Followers | None = None,
        decode_graphs: DecodeGraphs | None = None,
        rows_as_decodes: bool = False,
    ):
        """`decode_kernel`: the decode attention kernel (None: the torch path). `kv_connector`: told
        of each layer's KV as it is computed. A rank of a multi-worker instance also has `pipe`
        (the stage-to-stage link), `returns_logits` (whether it hands the logits to rank 0)
        and, on rank 0, `followers` (the other ranks). `decode_graphs`: decode-only steps replayed
        from CUDA graphs (None: every step eager). `rows_as_decodes`: every row's attention, a
        prompt's too, through the decode kernel (EngineConfig.batch_invariant; needs the kernel)."""
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.block_size = kv_cache.block_size
        self.decode_kernel = decode_kernel
        self.kv_connector = kv_connector if kv_connector is not None and kv_connector.saves_layers else None
        self.pipe = pipe
        self.returns_logits = returns_logits
        self.followers = followers
        self.decode_graphs = decode_graphs
        self.rows_as_decodes = rows_as_decodes and decode_kernel is not None
        self.dtype = next(model.parameters()).dtype

    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        generator_of: Callable[[Request], torch.Generator | None],
        mask: Callable[[list[Request], torch.Tensor], None] | None = None,
    ) -> dict[str, SampledToken]:
        """Run a step; `mask(requests, logits)` may forbid tokens (structured output) before sampling."""
        chunks = _decodes_first(out.chunks)
        # A multi-worker instance: the other ranks start the same step before this one computes.
        pending = self.followers.submit(chunks) if self.followers is not None else None
        logits = self._forward_logits(chunks)
        if pending is not None:
            remote = pending.result()  # the last stage's logits when this rank is not the last stage
            logits = remote if logits is None else logits
        sampling = [c for c in chunks if c.samples]
        if not sampling:
            return {}
        requests = [c.request for c in sampling]
        params = [r.sampling_params for r in requests]
        raw = logits
        if mask is not None:
            if any(p.structured is not None and p.logprobs is not None for p in params):
                raw = logits.clone()  # logprobs are the model's own, as without a grammar
            mask(requests, logits)
        tokens, logprobs = self.sampler(logits, params, [generator_of(r) for r in requests], raw_logits=raw)
        return {r.request_id: SampledToken(t, lp) for r, t, lp in zip(requests, tokens, logprobs)}

    @torch.inference_mode()
    def execute_shard(self, chunks) -> torch.Tensor | None:
        """A non-driver rank's part of a step (chunks already in the driver's order): the logits
        of the sampled rows from the last stage's first TP rank, None from the others."""
        return self._forward_logits(chunks)

    @torch.inference_mode()
    def logits_at_every_position(self, chunk: ScheduledChunk) -> torch.Tensor:
        """One chunk's logits at each of its positions, not only the last (scoring a text:
        perplexity). A single-worker engine only: no other rank takes part."""
        if self.followers is not None or not (self.model.is_first_stage and self.model.is_last_stage):
            raise ValueError("scoring needs a single-worker engine")
        input_ids, positions, meta = self._prepare([chunk])
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        return self.model.compute_logits(hidden, meta.decode_rows)

    def _forward_logits(self, chunks) -> torch.Tensor | None:
        if self._replays(chunks):
            return self._replay(chunks)
        input_ids, positions, meta = self._prepare(chunks)
        return self._forward_prepared(chunks, input_ids, positions, meta)

    def _replays(self, chunks) -> bool:
        """Whether a captured graph runs this step: decodes of generated tokens alone, as many
        as a graph holds (prefill chunks and the step after a prompt's last chunk run eagerly)."""
        graphs = self.decode_graphs
        if graphs is None or not chunks or _generated_decodes(chunks) != len(chunks):
            return False
        return graphs.fits(len(chunks), max(len(c.request.block_ids) for c in chunks))

    def _replay(self, chunks) -> torch.Tensor:
        return self.decode_graphs.run(
            [c.token_ids[0] for c in chunks],
            [c.start for c in chunks],
            [self._slot(c.request.block_ids, c.start) for c in chunks],
            [c.request.block_ids for c in chunks],
        )

    def _forward_prepared(self, chunks, input_ids, positions, meta) -> torch.Tensor | None:
        connector = self.kv_connector
        after_layer = None if connector is None else (lambda index: connector.save_kv_layer(index, chunks))
        hidden, residual = None, None
        if not self.model.is_first_stage:
            hidden, residual = self.pipe.recv_prev(
                len(positions), self.model.config.hidden_size, self.dtype, self.device
            )
        out = self.model(
            input_ids, positions, self.kv_cache, meta, hidden_states=hidden, residual=residual, after_layer=after_layer
        )
        if connector is not None:
            connector.forward_done(chunks)
        if not self.model.is_last_stage:
            self.pipe.send_next(*out)
            return None
        if not self.returns_logits or not any(c.samples for c in chunks):
            return None
        ends = list(itertools.accumulate(c.num_new_tokens for c in chunks))
        last_rows = [ends[i] - 1 for i, c in enumerate(chunks) if c.samples]
        if len(last_rows) < out.shape[0]:  # else every row samples (a decode-only step): no gather
            out = out.index_select(0, torch.tensor(last_rows, device=self.device))
        return self.model.compute_logits(out, meta.decode_rows)

    def _prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's inputs, and what its layers need to know of it (its quantized GEMMs take
        their path by row: `decode_rows`)."""
        input_ids, positions, meta = self._prepare_rows(chunks)
        meta.decode_rows = _generated_decodes(chunks)
        return input_ids, positions, meta

    def _prepare_rows(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        if self.rows_as_decodes:
            return self._prepare_as_decodes(chunks)
        num_decodes = sum(1 for c in chunks if is_decode(c))
        token_ids: list[int] = []
        positions: list[int] = []
        for c in chunks:
            token_ids.extend(c.token_ids)
            positions.extend(range(c.start, c.start + c.num_new_tokens))
        meta = AttentionMetadata(slot_mapping=torch.empty(0), num_decode_tokens=num_decodes)
        decodes = chunks[:num_decodes]
        slots = [self._slot(c.request.block_ids, c.start) for c in decodes]
        meta.decode = self._decode_batch(decodes) if decodes else None
        query_start = num_decodes
        for c in chunks[num_decodes:]:
            meta.prefills.append(self._prefill_span(c, query_start))
            slots.extend(self._slot(c.request.block_ids, p) for p in range(c.start, c.start + c.num_new_tokens))
            query_start += c.num_new_tokens
        meta.slot_mapping = self._long(slots)
        return self._long(token_ids), self._long(positions), meta

    def _prepare_as_decodes(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Every row of the step as a decode of its own position (batch_invariant): its attention
        then takes the same kernel, over the same blocks, whether it was computed as a prompt's
        row, a decode, or recomputed after a migration, so its numbers never depend on which."""
        token_ids, positions, slots, tables = [], [], [], []
        for c in chunks:
            token_ids.extend(c.token_ids)
            for p in range(c.start, c.start + c.num_new_tokens):
                positions.append(p)
                slots.append(self._slot(c.request.block_ids, p))
                tables.append(c.request.block_ids[: p // self.block_size + 1])
        width = max(len(t) for t in tables)
        padded = [b for t in tables for b in itertools.chain(t, itertools.repeat(0, width - len(t)))]
        block_tables = torch.tensor(padded, dtype=torch.int32, device=self.device).view(len(tables), width)
        context_lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=self.device)
        decode = DecodeBatch(block_tables, context_lens, self.block_size, self.decode_kernel)
        meta = AttentionMetadata(slot_mapping=self._long(slots), num_decode_tokens=len(positions), decode=decode)
        return self._long(token_ids), self._long(positions), meta

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _decode_batch(self, decodes: list[ScheduledChunk]) -> DecodeBatch:
        tables = [c.request.block_ids for c in decodes]
        width = max(len(t) for t in tables)
        padded = [b for t in tables for b in itertools.chain(t, itertools.repeat(0, width - len(t)))]
        block_tables = torch.tensor(padded, dtype=torch.int32, device=self.device).view(len(decodes), width)
        context_lens = torch.tensor([c.start + 1 for c in decodes], dtype=torch.int32, device=self.device)
        return DecodeBatch(block_tables, context_lens, self.block_size, self.decode_kernel)

    def _prefill_span(self, c: ScheduledChunk, query_start: int) -> PrefillSpan:
        end = c.start + c.num_new_tokens
        block_ids = self._long(c.request.block_ids[: -(-end // self.block_size)])
        mask = None
        if c.start > 0:  # earlier chunks or a cached prefix: attend to all of them, causal within
            pos = torch.arange(c.start, end, device=self.device)
            mask = torch.arange(end, device=self.device).unsqueeze(0) <= pos.unsqueeze(1)
        return PrefillSpan(query_start, c.num_new_tokens, c.start, block_ids, mask)


def is_decode(c: ScheduledChunk) -> bool:
    return computes_as_decode(c.start, c.num_new_tokens)


def _decodes_first(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """Decodes of generated tokens, then those of a prompt's last token (its prefix cached),
    then prefill chunks: the first two are the attention's decode batch, and the first alone
    the rows quantized GEMMs take their kernel for (a prompt's rows are computed in float32,
    cached prefix or not: layers/quantized.py)."""
    decodes = [c for c in chunks if is_decode(c)]
    return (
        [c for c in decodes if c.generates]
        + [c for c in decodes if not c.generates]
        + [c for c in chunks if not is_decode(c)]
    )


def _generated_decodes(chunks: list[ScheduledChunk]) -> int:
    """How many leading chunks (in `_decodes_first`'s order) decode a generated token."""
    return next((i for i, c in enumerate(chunks) if not (c.generates and is_decode(c))), len(chunks))
