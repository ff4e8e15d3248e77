"""The hybrid KV manager: one block table per KV-cache group, one shared pool.

Models that mix full-attention and sliding-window layers (Gemma 3: five sliding layers to
one full one) group their layers (``spec.py``); each group keeps a table per request, and
every group's blocks come from one ``BlockPool``. A sliding-window group keeps only the blocks
its queries can still see: before each allocation, blocks that lie wholly before the window of
the step's first query go back to the pool (cached ones stay evictable for prefix reuse) and
their table entries point at the null block.

Example (block_size 4, window 6, one full group F and one sliding group S): a request with 13
computed tokens schedules 1 more. Its first query is at position 13 and sees keys 8..13, so S
frees blocks 0 and 1 (positions 0..7): F = [a, b, c, d], S = [null, null, g, h]. At 8K tokens,
window 512 and a 2K chunk, a sliding group holds ~(511 + 2048) / 16 + 1 blocks, not 512.

Prefix caching across groups: a hit of L tokens counts only where every group has what a
request resuming at L reads: full groups every block before L, sliding groups the blocks of
the last W - 1 tokens before L. L is lowered until all groups agree (as vLLM's hybrid
coordinator does). Each group caches its own blocks under (group, block hash).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence

from pagedllm.core.kv_cache.block import KVCacheBlock
from pagedllm.core.kv_cache.block_pool import BlockPool
from pagedllm.core.kv_cache.interface import KVCacheManagerBase
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.kv_cache.spec import KVCacheGroups, SlidingWindowSpec, cdiv
from pagedllm.core.kv_cache.swap import SwapSpace
from pagedllm.core.request import Request


class SlidingWindowGroup(KVCacheManager):
    """One sliding-window group's tables: the single-group manager, plus freeing what leaves
    the window and a prefix hit that needs only the window's blocks."""

    def __init__(self, spec: SlidingWindowSpec, **kwargs) -> None:  # noqa: ANN003
        super().__init__(0, spec.block_size, **kwargs)
        self.spec = spec
        # blocks holding the W - 1 keys before a block-aligned position
        self.window_blocks = cdiv(spec.sliding_window - 1, spec.block_size)
        self.null_block = self.block_pool.null_block
        assert self.null_block is not None, "a sliding-window group needs the null block"
        self.num_skipped: dict[str, int] = {}  # leading table entries set to the null block

    def remove_skipped(self, request: Request, num_computed_tokens: int) -> None:
        """Give back the blocks before the window of a step starting at
        ``num_computed_tokens`` (the older ones evicted first when cached)."""
        rid = request.request_id
        first = self.spec.first_needed_block(num_computed_tokens)
        start = self.num_skipped.get(rid, 0)
        if first <= start:
            return
        blocks = self.req_to_blocks.get(rid)
        if not blocks:
            return
        first = min(first, len(blocks))
        if first <= start:
            return
        null = self.null_block
        gone = [b for b in blocks[start:first] if b is not null]
        blocks[start:first] = [null] * (first - start)
        self.num_skipped[rid] = first
        self.block_pool.free_blocks(gone)

    def longest_hit(self, request: Request, max_blocks: int) -> int:
        """The most blocks L <= ``max_blocks`` such that the blocks a request resuming at
        L x block_size reads (those of its last W - 1 tokens) are all cached.

        Example: bs 4, W 6 -> 2 blocks before L; cached [y, n, y, y, y] -> L = 5 (blocks 3, 4).
        """
        need = self.window_blocks
        hashes = self._block_hashes(request)[:max_blocks]
        best = run = 0
        for i, h in enumerate(hashes):
            run = run + 1 if self.block_pool.get_cached_block(self._key(h)) is not None else 0
            if run >= min(need, i + 1):
                best = i + 1
        return best

    def hit_blocks(self, request: Request, num_blocks: int) -> list[KVCacheBlock]:
        """The table of a hit of ``num_blocks`` blocks: nulls, then the window's blocks."""
        need = min(self.window_blocks, num_blocks)
        hashes = self._block_hashes(request)
        out: list[KVCacheBlock] = [self.null_block] * (num_blocks - need)  # type: ignore[list-item]
        for h in hashes[num_blocks - need : num_blocks]:
            block = self.block_pool.get_cached_block(self._key(h))
            assert block is not None
            out.append(block)
        return out

    def fork(self, parent: Request, child: Request) -> None:
        super().fork(parent, child)
        self.num_skipped[child.request_id] = self.num_skipped.get(parent.request_id, 0)

    def free(self, request: Request) -> None:
        super().free(request)
        self.num_skipped.pop(request.request_id, None)


class HybridKVCacheManager(KVCacheManagerBase):
    """A table per KV-cache group over one pool (see the module docstring)."""

    def __init__(
        self,
        kv_groups: KVCacheGroups,
        num_blocks: int,
        enable_caching: bool = False,
        num_host_blocks: int = 0,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        self.kv_groups = kv_groups
        self.block_size = kv_groups.block_size
        self.enable_caching = enable_caching
        self.max_chunk = max_num_batched_tokens
        self.block_pool = BlockPool(num_blocks, enable_caching, reserve_null=True)
        self.swap_space = SwapSpace(num_host_blocks)
        hashes: dict = {}
        self.groups: list[KVCacheManager] = []
        for g, group in enumerate(kv_groups.groups):
            kw = dict(block_pool=self.block_pool, group=g, hashes=hashes)
            if isinstance(group.spec, SlidingWindowSpec):
                self.groups.append(
                    SlidingWindowGroup(group.spec, enable_caching=enable_caching, **kw)
                )
            else:
                self.groups.append(KVCacheManager(0, self.block_size, enable_caching, **kw))
        self.full = [m for m in self.groups if not isinstance(m, SlidingWindowGroup)]
        self.sliding = [m for m in self.groups if isinstance(m, SlidingWindowGroup)]
        # swapped-out request -> per group: (table length, indices of the non-null entries)
        self._swapped: dict[str, list[tuple[int, list[int]]]] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ capacity
    @property
    def num_cow_copies(self) -> int:  # type: ignore[override]
        return sum(m.num_cow_copies for m in self.groups)

    def _blocks_for(self, num_tokens: int) -> int:
        return sum(
            g.spec.max_blocks_needed(num_tokens, self.max_chunk) for g in self.kv_groups.groups
        )

    def token_capacity(self) -> int:
        """The most tokens one request can hold alone (unbounded with no full group)."""
        usable = self.num_blocks - 1
        if not self.full:
            return sys.maxsize if self._blocks_for(1 << 40) <= usable else 0
        lo, hi = 0, self.num_blocks * self.block_size  # invariant: lo fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self._blocks_for(mid) <= usable else (lo, mid - 1)
        return lo

    def can_allocate(self, request: Request, budget: int) -> bool:
        bs = self.block_size
        rid = request.request_id
        if request.swapped:
            start = request.num_computed_tokens
            end = cdiv(start + min(request.num_tokens - start, budget), bs)
            layout = self._swapped.get(rid, [])
            need = self.swap_space.num_swapped_blocks(rid) + sum(
                max(0, end - length) for length, _ in layout
            )
            return need <= self.num_free_blocks()
        hit = self.num_cached_prefix_tokens(request)
        end = cdiv(hit + min(request.num_tokens - hit, budget), bs)
        need = 0
        for m in self.groups:
            lo = m.spec.first_needed_block(hit) if isinstance(m, SlidingWindowGroup) else 0
            need += end - max(lo, hit // bs)
        return need <= self.num_free_blocks()

    # -------------------------------------------------------------- prefix cache
    def _hit_num_blocks(self, request: Request) -> int:
        if not self.uses_prefix_cache(request):
            return 0
        n = (request.num_tokens - 1) // self.block_size
        for m in self.full:
            n = min(n, m.num_cached_prefix_tokens(request) // self.block_size)
        while n > 0:
            lowest = min((m.longest_hit(request, n) for m in self.sliding), default=n)
            if lowest == n:
                break
            n = lowest
        return n

    def num_cached_prefix_tokens(self, request: Request) -> int:
        return self._hit_num_blocks(request) * self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Per group, the table of the longest hit every group has; and its tokens."""
        n = self._hit_num_blocks(request)
        if n == 0:
            return [], 0
        tables: list[list[KVCacheBlock]] = []
        for m in self.groups:
            if isinstance(m, SlidingWindowGroup):
                tables.append(m.hit_blocks(request, n))
            else:
                tables.append(m.get_computed_blocks(request)[0][:n])
        return tables, n * self.block_size

    # ---------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[list[KVCacheBlock]] | None:
        """Room in every group at once, or None with nothing allocated (blocks that left a
        sliding window may have gone back to the pool: they were unreadable anyway)."""
        if not new_computed_blocks and not num_lookahead_tokens:
            if self._fits_in_own_blocks(request, num_new_tokens):
                return []
        computed = new_computed_blocks or [None] * len(self.groups)
        num_hit = len(new_computed_blocks[0]) * self.block_size if new_computed_blocks else 0
        for m in self.sliding:
            m.remove_skipped(request, request.num_computed_tokens + num_hit)
        need = sum(
            m.num_blocks_to_allocate(request, num_new_tokens, c, num_lookahead_tokens)
            for m, c in zip(self.groups, computed)
        )
        if need > self.num_free_blocks():
            return None
        return [
            m.allocate(request, num_new_tokens, c, num_lookahead_tokens)
            for m, c in zip(self.groups, computed)
        ]

    def _fits_in_own_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """The common decode case, cheaply: in every group the new tokens fit in blocks the
        request holds alone. Then only what left a window is given back and full blocks are
        registered; nothing is allocated or copied."""
        rid = request.request_id
        bs = self.block_size
        start = request.num_computed_tokens
        end = start + num_new_tokens
        i = start // bs
        for m in self.groups:
            blocks = m.req_to_blocks.get(rid)
            if not blocks or end > len(blocks) * bs or (i < len(blocks) and blocks[i].ref_cnt > 1):
                return False
        for m in self.sliding:
            m.remove_skipped(request, start)  # type: ignore[attr-defined]
        if self.enable_caching:
            num_full = min(end, request.num_tokens) // bs
            for m in self.groups:
                m._cache_full_blocks(request, m.req_to_blocks[rid], num_full)
        return True

    def new_block_ids(self, new_blocks: Sequence[list[KVCacheBlock]]) -> tuple[list[int], ...]:
        if not any(new_blocks):
            return ()
        return tuple([b.block_id for b in blocks] for blocks in new_blocks)

    def get_block_table(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(m.get_block_ids(request_id) for m in self.groups)

    def request_tables(self) -> Iterator[tuple[str, list[int]]]:
        null = self.block_pool.null_block
        for m in self.groups:
            for rid, blocks in m.req_to_blocks.items():
                yield rid, [b.block_id for b in blocks if b is not null]

    def free(self, request: Request) -> None:
        for m in self.groups:
            m.free(request)
        if request.is_finished:
            self._swapped.pop(request.request_id, None)
            self.swap_space.discard(request.request_id)

    def fork(self, parent: Request, child: Request) -> None:
        for m in self.groups:
            m.fork(parent, child)

    def take_replaced(self, request_id: str) -> list[tuple[int, int, int]]:
        return [e for m in self.groups for e in m.take_replaced(request_id)]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return [p for m in self.groups for p in m.take_pending_copies()]

    # ---------------------------------------------------------------------- swap
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Every group's live blocks to host memory (the null entries stay null)."""
        rid = request.request_id
        null = self.block_pool.null_block
        layout, blocks = [], []
        for m in self.groups:
            table = m.req_to_blocks.get(rid, [])
            live = [i for i, b in enumerate(table) if b is not null]
            layout.append((len(table), live))
            blocks.extend(table[i] for i in live)
        if not blocks or not self.swap_space.can_hold(len(blocks)):
            return None
        pairs = self.swap_space.swap_out(rid, blocks)
        self._swapped[rid] = layout
        for m in self.groups:
            m.free(request)
        return pairs

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        rid = request.request_id
        n = self.swap_space.num_swapped_blocks(rid)
        if n > self.num_free_blocks():
            return None
        blocks = self.block_pool.get_new_blocks(n)
        it = iter(blocks)
        null = self.block_pool.null_block
        for m, (length, live) in zip(self.groups, self._swapped.pop(rid)):
            table: list[KVCacheBlock] = [null] * length  # type: ignore[list-item]
            for i in live:
                table[i] = next(it)
            m.req_to_blocks[rid] = table
            m.num_cached_blocks[rid] = 0  # re-registered as they are full
            if isinstance(m, SlidingWindowGroup):
                m.num_skipped[rid] = live[0] if live else length
        return self.swap_space.swap_in(rid, blocks)

    # --------------------------------------------------------------------- checks
    def check_integrity(self) -> None:
        """Every block's ref count equals the tables (of every group) holding it; free +
        used + the null block == total."""
        self._check_tables(t for m in self.groups for t in m.req_to_blocks.values())
