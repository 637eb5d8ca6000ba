"""Decode steps on CUDA replayed from CUDA graphs: one replay instead of hundreds of launches.

On an H100 a Llama-3-8B decode step of one request should read 15 GiB of weights in about 5 ms,
and took 22 ms eagerly: the rest was the host launching ~25 kernels a layer and running Python
between them (loadtest/RESULTS.md, "The GPU path"). A graph records those launches once per
batch size and replays them in one call, so the host cost of a step no longer grows with the
model's depth.

A graph's tensors are fixed, so a step is copied into static buffers (token ids, positions, cache
slots, block tables, context lengths) and padded up to the next captured batch size. Padded rows
repeat the first decode (its token, position, slot and blocks): they compute the same K and V
and write them to the same slot, which leaves the cache as it was, and their logits are dropped.
(A duplicate index in index_copy_ is harmless only because the values are equal.)

Captured only where a step is nothing but decodes of one worker: no prefill chunk (its shapes
vary with every prompt), no KV streaming hook, no pipeline or tensor-parallel peer, and the
decode attention is the Triton kernel (the torch path sizes its buckets on the host).
"""

from __future__ import annotations

import itertools
import logging

import torch

from disagg.engine.kv_cache import KVCache
from disagg.engine.layers.attention import AttentionMetadata, DecodeBatch
from disagg.engine.layers.cpu_kernels import DecodeKernel

logger = logging.getLogger(__name__)

# Batch sizes captured: small ones exactly (a lone request is the latency case), then every 8.
SMALL_BATCHES = (1, 2, 4)
BATCH_STEP = 8


def captured_sizes(max_batch: int) -> list[int]:
    """The batch sizes that get a graph, ascending; the largest is max_batch itself."""
    sizes = {b for b in SMALL_BATCHES if b < max_batch}
    sizes.update(range(BATCH_STEP, max_batch, BATCH_STEP))
    sizes.add(max_batch)
    return sorted(sizes)


def padded_size(sizes: list[int], batch: int) -> int | None:
    """The smallest captured size that holds `batch` decodes (None: larger than any)."""
    return next((s for s in sizes if s >= batch), None)


class DecodeGraphs:
    """The captured decode steps of one model and cache, and the static buffers they read."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        kernel: DecodeKernel,
        device: torch.device,
        max_batch: int,
        max_blocks_per_seq: int,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.kernel = kernel
        self.device = device
        self.sizes = captured_sizes(max_batch)
        self.max_blocks = max_blocks_per_seq
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_batch, **long)
        self.positions = torch.zeros(max_batch, **long)
        self.slots = torch.zeros(max_batch, **long)
        self.block_tables = torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.logits = torch.empty(max_batch, model.config.vocab_size, dtype=torch.float32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps run from a graph (tests and logs read it)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per batch size, largest first so the smaller ones reuse its memory."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # the warm-up: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs captured for decode batches %s", self.sizes)

    def fits(self, batch: int, widest_table: int) -> bool:
        return padded_size(self.sizes, batch) is not None and widest_table <= self.max_blocks

    def run(
        self, token_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        """One decode step of len(token_ids) requests: their logits [B, vocab] (float32)."""
        batch = len(token_ids)
        size = padded_size(self.sizes, batch)
        pad = size - batch
        self._fill(self.input_ids, token_ids, pad)
        self._fill(self.positions, positions, pad)
        self._fill(self.slots, slots, pad)
        self._fill(self.context_lens, [p + 1 for p in positions], pad)
        self._fill_tables(tables, pad)
        self._graphs[size].replay()
        self.replays += 1
        return self.logits[:batch]

    def _fill_tables(self, tables: list[list[int]], pad: int) -> None:
        """Only the columns this step's longest table covers: a table as wide as the longest
        context the model takes (8,192 blocks for a 128k-token Llama) would cost the host more to
        build than the whole step. Columns past a request's own blocks keep stale ids, which the
        kernel never reads (it stops at the context length)."""
        width = max(len(t) for t in tables)
        padded = [b for t in tables + tables[:1] * pad for b in itertools.chain(t, itertools.repeat(0, width - len(t)))]
        host = torch.tensor(padded, dtype=torch.int32).view(len(tables) + pad, width)
        self.block_tables[: len(host), :width].copy_(host, non_blocking=True)

    @staticmethod
    def _fill(buffer: torch.Tensor, values: list[int], pad: int) -> None:
        """The step's values, then `pad` copies of the first (see the module docstring)."""
        host = torch.tensor(values + values[:1] * pad, dtype=buffer.dtype)
        buffer[: len(host)].copy_(host, non_blocking=True)

    def _forward(self, size: int) -> None:
        """The step of `size` decodes, its logits into the one static buffer every graph shares."""
        decode = DecodeBatch(self.block_tables[:size], self.context_lens[:size], self.kv_cache.block_size, self.kernel)
        meta = AttentionMetadata(slot_mapping=self.slots[:size], num_decode_tokens=size, decode=decode)
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, meta)
        self.logits[:size].copy_(self.model.compute_logits(hidden))
