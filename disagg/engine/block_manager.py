"""KV-cache block bookkeeping: ids, reference counts, free list and prefix hashes.

Pure Python (no torch) so the scheduler can be tested without a model. The physical tensors
live in kv_cache.py; this file only decides which block ids a request owns.

Prefix caching (the effect of SGLang's RadixAttention, vLLM's hash-based form): every full block
gets a chained hash of (parent hash, its tokens). A freed block keeps its hash and stays in the
free list as evictable; a later request whose prompt starts with the same tokens takes it back
instead of recomputing. Hits are verified against the stored tokens, so a hash collision can
never serve wrong KV.

Sliding windows (`sliding_window`: the window every attention layer shares; None: global
attention, or layers of different windows): once a request has computed n positions, a block
all of whose positions are below n - W + 1 is never read again (a decode of context c reads from
position c - W, a chunk starting at s from s - W + 1). Such leading blocks are released after
each step: their entries in the request's block table become PLACEHOLDER (never read, never
freed twice, never hashed; `Request.num_released_blocks` counts them) and the blocks go back to
the free list as a finished request's do, a hashed one kept as evictable prefix cache. A model
with layers of several windows (Gemma 3: local and global) holds every block: releasing per
layer group needs one block table per group (vLLM's hybrid allocator), which this is not.

Lower tiers (`lower`, disagg.engine.kv_tiers): a cached block evicted for reuse goes down to
them instead of being lost, and a prefix lookup that misses in the pool goes on there: each
block found below is copied back into a free pool block (evicting, and so moving down, what that
block held) and becomes an ordinary cached block, which the request then takes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from disagg.request import Request, SamplingParams

# A released block's entry in a block table (see above): no block's id. Negative, so that a read
# through it fails loudly on the torch paths instead of reading another request's KV.
PLACEHOLDER = -1


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    # Tuples of ints hash identically in every process (no PYTHONHASHSEED effect), so these
    # hashes can be shared through a cluster-wide prefix index. Not None: before Python 3.12
    # its hash is its address, different in every process (the router never found a prefix).
    return hash((-1 if parent is None else parent, tokens))


def out_of_window_blocks(num_computed_tokens: int, block_size: int, window: int | None) -> int:
    """The leading blocks of a request no layer reads again once `num_computed_tokens` positions
    are computed, under a sliding window of `window` tokens on every layer (None: none)."""
    if window is None:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size


def max_blocks_held(num_tokens: int, block_size: int, window: int | None, chunk_tokens: int) -> int:
    """The most blocks a request of `num_tokens` holds at once, computed in chunks of at most
    `chunk_tokens` (a step's budget): every block without a window; under one, those of a chunk
    and of the window before it."""
    every_block = -(-num_tokens // block_size)
    if window is None:
        return every_block
    return min(every_block, -(-(window - 1 + max(1, chunk_tokens)) // block_size) + 1)


def num_placeholders(block_ids: list[int]) -> int:
    """How many entries a block table starts with that are released (PLACEHOLDER)."""
    n = 0
    while n < len(block_ids) and block_ids[n] == PLACEHOLDER:
        n += 1
    return n


def num_held(block_ids: list[int]) -> int:
    """The blocks a block table really holds (its entries that are not placeholders)."""
    return len(block_ids) - num_placeholders(block_ids)


class LowerTiers(Protocol):
    """What the block manager needs of the tiers under its pool (kv_tiers.TieredStore)."""

    def block_cached(self, block_hash: int) -> None: ...
    def block_taken(self, num_blocks: int) -> None: ...
    def block_evicted(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None: ...
    def fetch(self, block_hash: int, tokens: tuple[int, ...]) -> object | None: ...
    def load(self, block_id: int, block_hash: int, fetched: object) -> None: ...


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        lower: LowerTiers | None = None,
    ):
        """`sliding_window`: the window every attention layer of the model shares (its blocks
        are released as they fall out of it); None: every block is held to the end. `lower`:
        the tiers under the pool (None: an evicted block is lost); not with a sliding window."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1 or None, got {sliding_window!r}")
        self.num_total_blocks = num_blocks
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        if lower is not None and (sliding_window is not None or not enable_prefix_caching):
            raise ValueError("lower tiers: need prefix caching and no sliding window")
        self.lower = lower
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_tokens: dict[int, tuple[int, ...]] = {}
        self._cached: dict[int, int] = {}  # hash -> block id
        # Free blocks in eviction order: plain blocks at the front (used first),
        # cached ones at the back (least recently freed evicted first).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.peak_num_used_blocks = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_total_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def num_out_of_window(self, num_computed_tokens: int) -> int:
        """A request's leading blocks that no layer reads again after `num_computed_tokens`."""
        return out_of_window_blocks(num_computed_tokens, self.block_size, self.sliding_window)

    def max_blocks_held(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a request of `num_tokens` holds at once (see max_blocks_held)."""
        return max_blocks_held(num_tokens, self.block_size, self.sliding_window, chunk_tokens)

    # ---- prefix cache --------------------------------------------------------------------
    def cached_hashes(self, limit: int) -> list[int]:
        """The chained hashes of (at most `limit` of the newest) cached blocks: what a router
        needs to predict how much of a prompt this instance would not recompute. Safe to call
        from another thread (a snapshot; empty if the cache changed under it)."""
        try:
            return list(self._cached)[-limit:]
        except RuntimeError:  # the engine thread changed it meanwhile: the next report has it
            return []

    @staticmethod
    def prompt_hashes(token_ids: list[int], block_size: int) -> list[int]:
        """The chained hashes of a prompt's blocks that a prefix-cache lookup would try (every
        full block but the one holding the last token, which is always computed)."""
        hashes, parent = [], None
        for i in range((len(token_ids) - 1) // block_size):
            parent = chain_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens.

        At least one token is left uncached: the model must run on something to produce logits.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self._hashes_of(request, (request.num_tokens - 1) // self.block_size)
        hits: list[int] = []
        for i, h in enumerate(hashes):
            block_id = self._cached.get(h)
            if block_id is None or self._block_tokens.get(block_id) != self._tokens_of(request, i):
                break
            hits.append(block_id)
        if self.lower is not None:
            self._load_from_lower(request, hashes, hits)
        return hits

    def _tokens_of(self, request: Request, i: int) -> tuple[int, ...]:
        return tuple(request.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _load_from_lower(self, request: Request, hashes: list[int], hits: list[int]) -> None:
        """Extend `hits` with the blocks after them that a lower tier holds, each copied into a
        free block. Each takes one free block and spares the request one fresh block: what it
        can allocate stays the same, so this stops only when no free block is left."""
        for i in range(len(hits), len(hashes)):
            if self._num_takeable(hits) < 1:
                return
            fetched = self.lower.fetch(hashes[i], self._tokens_of(request, i))
            if fetched is None:
                return
            block_id = self._free_block_outside(set(hits))
            del self._free[block_id]
            self._evict(block_id)  # what it held goes down first
            self.lower.load(block_id, hashes[i], fetched)
            self._register(block_id, hashes[i], self._tokens_of(request, i))
            self._free[block_id] = None  # cached and free: the most recently used
            hits.append(block_id)

    def _free_block_outside(self, excluded: set[int]) -> int:
        """The free block to reuse first that is not in `excluded`."""
        return next(b for b in self._free if b not in excluded)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the hashes of the request's blocks that became full and computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        hashes = self._hashes_of(request, num_full)
        for i in range(request.num_released_blocks, num_full):  # released: hashed before, or never held
            block_id = request.block_ids[i]
            if self._block_hash[block_id] is not None:
                continue
            h = hashes[i]
            if h in self._cached:  # same content computed twice concurrently: keep the first
                continue
            self._register(block_id, h, self._tokens_of(request, i))
            if self.lower is not None:
                self.lower.block_cached(h)

    def _register(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        self._block_hash[block_id] = block_hash
        self._block_tokens[block_id] = tokens
        self._cached[block_hash] = block_id

    def _hashes_of(self, request: Request, num_blocks: int) -> list[int]:
        hashes = request.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(chain_hash(parent, tuple(request.token_ids[i * bs : (i + 1) * bs])))
        return hashes

    # ---- blocks lent to a peer, or taken from one (disagg.kv_transfer.peer_blocks) -----------
    def cached_run(self, token_ids: list[int], num_blocks: int) -> list[int]:
        """The pool's blocks holding the longest cached run of the first `num_blocks` full blocks
        of `token_ids` (verified against the tokens; the lower tiers are not searched)."""
        if not self.enable_prefix_caching or self.sliding_window is not None:
            return []
        hits, parent, bs = [], None, self.block_size
        for i in range(min(num_blocks, len(token_ids) // bs)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, tokens)
            block_id = self._cached.get(parent)
            if block_id is None or self._block_tokens.get(block_id) != tokens:
                break
            hits.append(block_id)
        return hits

    def pin_cached_prefix(self, token_ids: list[int], num_blocks: int) -> list[int] | None:
        """The blocks of the first `num_blocks` full blocks of `token_ids`, each taken (so no
        allocation reuses it while a peer copies it: `unpin` gives them back); those only a
        lower tier holds are loaded back first. None, taking nothing, unless the pool and its
        tiers hold every one of them."""
        if num_blocks < 1 or len(token_ids) < num_blocks * self.block_size:
            return None
        hits = self.cached_run(token_ids, num_blocks)
        if len(hits) < num_blocks and self.lower is not None:
            # The prompt a lookup would make of them: one token past the blocks, always computed.
            probe = Request("peer-export", list(token_ids[: num_blocks * self.block_size]) + [0], SamplingParams())
            hits = self.find_cached_prefix(probe)
        if len(hits) < num_blocks:
            return None
        return [self._take(block_id, reuse_content=True) for block_id in hits]

    def unpin(self, block_ids: list[int]) -> None:
        """Give back blocks taken by `pin_cached_prefix` or `reserve_prefix_import`."""
        for block_id in reversed(block_ids):
            self._drop(block_id)

    def reserve_prefix_import(self, token_ids: list[int], num_blocks: int) -> tuple[int, list[int]] | None:
        """Blocks for the first `num_blocks` full blocks of `token_ids`, whose KV a peer sends:
        (how many leading ones the pool holds already, and the table: those, taken, then fresh
        blocks for the rest). None, taking nothing, when none is missing or there is no room."""
        hits = self.cached_run(token_ids, num_blocks)
        missing = num_blocks - len(hits)
        if missing < 1 or len(token_ids) < num_blocks * self.block_size or missing > self._num_takeable(hits):
            return None
        table = [self._take(block_id, reuse_content=True) for block_id in hits]
        table += [self._take(next(iter(self._free)), reuse_content=False) for _ in range(missing)]
        return len(hits), table

    def finish_prefix_import(self, token_ids: list[int], table: list[int]) -> None:
        """The table's blocks hold their KV now: the fresh ones join the prefix cache under
        their hashes, and the table is given back (its blocks stay cached, evictable)."""
        parent, bs = None, self.block_size
        for i, block_id in enumerate(table):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = chain_hash(parent, tokens)
            if self._block_hash[block_id] is None and parent not in self._cached:
                self._register(block_id, parent, tokens)
                if self.lower is not None:
                    self.lower.block_cached(parent)
        self.unpin(table)

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] = (), skip_blocks: int = 0
    ) -> bool:
        skip, num_fresh = self._plan(request, num_new_tokens, cached_blocks, skip_blocks)
        return num_fresh <= self._num_takeable(cached_blocks[skip:])

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] = (), skip_blocks: int = 0
    ) -> bool:
        """Give the request enough blocks for `num_computed_tokens + num_new_tokens` tokens.

        `cached_blocks` (from find_cached_prefix, for a request that owns no blocks yet) are
        taken first and count as computed tokens ahead of the new ones; those the window already
        left behind are not taken (placeholders). `skip_blocks` (for a request that owns no
        blocks yet): as many first blocks are not needed here (their KV is computed elsewhere and
        out of the window by the time this engine reads the request): placeholders too.
        Returns False, changing nothing, when there are not enough free blocks.
        """
        skip, num_fresh = self._plan(request, num_new_tokens, cached_blocks, skip_blocks)
        if num_fresh > self._num_takeable(cached_blocks[skip:]):
            return False
        if skip:
            request.block_ids.extend([PLACEHOLDER] * skip)
            request.num_released_blocks = skip
        for block_id in cached_blocks[skip:]:
            self._take(block_id, reuse_content=True)
        if self.lower is not None and cached_blocks:
            self.lower.block_taken(len(cached_blocks))
        request.block_ids.extend(cached_blocks[skip:])
        for _ in range(num_fresh):
            request.block_ids.append(self._take(next(iter(self._free)), reuse_content=False))
        self.peak_num_used_blocks = max(self.peak_num_used_blocks, self.num_used_blocks)
        return True

    def release_out_of_window(self, request: Request) -> None:
        """After the request's num_computed_tokens grew: release its leading blocks that fell out
        of the window (nothing without one). A hashed block stays in the prefix cache, evictable."""
        target = min(self.num_out_of_window(request.num_computed_tokens), len(request.block_ids))
        for i in range(request.num_released_blocks, target):
            self._drop(request.block_ids[i])
            request.block_ids[i] = PLACEHOLDER
        request.num_released_blocks = max(request.num_released_blocks, target)

    def free(self, request: Request) -> None:
        """Drop the request's references; blocks nobody else uses return to the free list."""
        # Reverse order: a sequence's tail blocks are the least likely to be shared, evict them first.
        for block_id in reversed(request.block_ids[request.num_released_blocks :]):
            self._drop(block_id)
        request.block_ids.clear()
        request.num_released_blocks = 0
        request.block_hashes.clear()

    def _drop(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free[block_id] = None
            if self._block_hash[block_id] is None:
                self._free.move_to_end(block_id, last=False)

    def _plan(self, request: Request, num_new_tokens: int, cached_blocks, skip_blocks: int) -> tuple[int, int]:
        """(leading placeholders, fresh blocks) an allocation makes. Cached blocks are computed
        tokens the request does not count yet (it owns no blocks)."""
        bs = self.block_size
        num_tokens = request.num_computed_tokens + len(cached_blocks) * bs + num_new_tokens
        skip = 0
        if not request.block_ids:
            skip = min(
                max(skip_blocks, self.num_out_of_window(len(cached_blocks) * bs)), self.num_blocks_for(num_tokens)
            )
        covered = len(request.block_ids) + max(skip, len(cached_blocks))
        return skip, max(0, self.num_blocks_for(num_tokens) - covered)

    def _num_takeable(self, cached_blocks) -> int:
        # Cached blocks that are currently free are not available for fresh allocation too.
        return len(self._free) - sum(1 for b in cached_blocks if self._ref_counts[b] == 0)

    def _take(self, block_id: int, reuse_content: bool) -> int:
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
            if not reuse_content:  # about to be overwritten: forget what it held
                self._evict(block_id)
        self._ref_counts[block_id] += 1
        return block_id

    def _evict(self, block_id: int) -> None:
        h = self._block_hash[block_id]
        if h is not None and self._cached.get(h) == block_id:
            if self.lower is not None:
                self.lower.block_evicted(block_id, h, self._block_tokens[block_id])
            del self._cached[h]
        self._block_hash[block_id] = None
        self._block_tokens.pop(block_id, None)
