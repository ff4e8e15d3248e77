"""The KV-Compress manager: a block table and a length per (request, layer, KV head).

A block holds ``block_size`` tokens of ONE KV head of ONE layer (``HeadPagedSpec``), so after
eviction each head of a request holds a different number of KVs. Per request the manager keeps
numpy arrays, updated with vectorized operations (no Python loop over layers, heads or
blocks):

- ``table`` [num_layers * num_kv_heads, max_blocks] int32: head ``lh = l * H + h``'s blocks;
- ``nblocks`` [LH]: blocks each head holds; ``lens`` [LH]: KVs each head holds, counting the
  tokens allocated for the step being scheduled.

Every new token adds one KV to every head, so a step of n tokens needs, per head,
``cdiv(lens + n, bs) - nblocks`` new blocks. Example: bs 4, lens [5, 8, 3], n = 2 ->
cdiv([7, 10, 5], 4) = [2, 3, 2], nblocks [2, 2, 1] -> 0, 1 and 1 new blocks.

Eviction runs on the model runner's device (``pagedllm/kvcompress/evict.py``), where the
scores are: the KV-Compress planner (``core/sched/kvc.py``) asks for it, the runner compacts
every evicted head's survivors into its first blocks and returns the new per-head lengths, and
``apply_compaction`` gives back the blocks past them.

Decisions (see docs/ARCHITECTURE.md, "KV-Compress"):
- Prefix caching (``enable_caching``): an entry is one full block of tokens in EVERY head,
  ``ids`` [LH] (before any eviction each head holds the same tokens). A request registers its
  full blocks while it has never been evicted from; a hit puts the entries' ids in the first
  columns of the new request's table. The cached prefix a request shares is protected: its
  KVs are never evicted nor moved (they sit at logical indices 0..P-1 in every head, the
  eviction treats positions < P like sinks) and its budget counts only the KVs after it.
  Before a request's first eviction (``settle_prefix``) its registered blocks that another
  request also holds join its protected prefix; the rest, which compaction will rewrite,
  either stay cached while the request moves to copies (free blocks permitting) or leave the
  cache (``detach_own``). Entries nobody holds stay cached (LRU) until their blocks are
  needed.
- Forks (n > 1) share the parent's blocks (ref counts); a request holding shared blocks copies
  them all into private ones at its next allocation (``take_pending_copies``), so each sequence
  then compresses its own blocks.
- Swap preemption copies a request's blocks to host blocks and back into new device blocks.
- Tensor parallelism (``spec.num_ranks`` ranks): the tables cover every rank's KV heads, in
  the model's order (head ``lh = l * H + h``, H all ranks' heads of a layer), and head h is
  rank ``h // (H / ranks)``'s: its blocks come from that rank's pool (``id_pool.py``: rank
  r's ids are ``r * num_blocks`` on), and an allocation fits only when every rank's pool
  holds its heads' blocks (``_missing``). Budgets and evictions stay per request over all
  heads; each rank's device sees only its heads (``kvcompress/shard.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedllm.core.kv_cache.block import BlockHash
from pagedllm.core.kv_cache.block_map import (
    CACHED,
    FREE,
    SHARED,
    USED,
    BlockMap,
    build_block_map,
)
from pagedllm.core.kv_cache.hashing import block_hash_extra, hash_request_blocks
from pagedllm.core.kv_cache.id_pool import make_id_pool
from pagedllm.core.kv_cache.interface import KVCacheManagerBase
from pagedllm.core.kv_cache.spec import HeadPagedSpec, cdiv
from pagedllm.core.request import Request


@dataclass
class HeadTable:
    """A request's whole per-head table, for the runner (plain data).

    table: [LH, n] int32 block ids; lens: [LH] KVs per head whose K/V are already computed."""

    table: np.ndarray
    lens: np.ndarray


@dataclass
class HeadBlocks:
    """New or replaced table entries: head ``lh[i]``'s block number ``index[i]`` is ``ids[i]``."""

    lh: np.ndarray
    index: np.ndarray
    ids: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


# what an allocation that needs no new block returns (shared: its arrays are empty, nobody
# writes them)
_NO_BLOCKS = HeadBlocks(*(np.zeros(0, dtype=np.int64) for _ in range(3)))


class _HeadState:
    """One request's tables (see the module docstring)."""

    def __init__(self, num_heads: int, max_blocks: int) -> None:
        self.table = np.zeros((num_heads, max_blocks), dtype=np.int32)
        self.nblocks = np.zeros(num_heads, dtype=np.int64)
        self._lens = np.zeros(num_heads, dtype=np.int64)
        # tokens added to every head since ``_lens`` was last written: a decode step's
        # allocation is a scalar add, and ``lens`` applies it when read (Example: _lens [5, 3],
        # 2 decode steps -> _lag 2; reading lens gives [7, 5] and _lag 0)
        self._lag = 0
        self.num_tokens = 0  # tokens allocated (lens grow with them, until an eviction)
        self.pending = 0  # tokens of the latest allocation (the step being scheduled)
        self.shared = False  # holds blocks another request also holds (a fork)
        # tokens every head can still take without a new block: min(nblocks * bs - lens).
        # Decode steps check it instead of the [LH] arithmetic (Example: bs 16, lens all 600,
        # nblocks all 38 -> room 8: the next 8 steps need no block and cost a scalar test).
        self.room = 0
        # every head holds the same number of KVs (and blocks): true until an eviction. Then a
        # step that needs blocks takes the same number for every head (a scalar rule)
        self.uniform = True
        # prefix caching: its leading blocks shared through the cache (protected: never
        # evicted, outside the budget); the leading blocks considered for registration so far;
        # frozen: registers nothing more (evicted from, forked or swapped: its table no
        # longer holds the blocks' plain tokens)
        self.prefix_blocks = 0
        self.registered = 0
        self.frozen = False

    @property
    def lens(self) -> np.ndarray:
        """[LH] KVs each head holds, counting the tokens allocated for the step being
        scheduled."""
        if self._lag:
            self._lens += self._lag
            self._lag = 0
        return self._lens

    @lens.setter
    def lens(self, value: np.ndarray) -> None:
        self._lens, self._lag = value, 0

    def add_tokens(self, n: int, num_new_tokens: int) -> None:
        """The step being scheduled allocates ``n`` KVs in every head (``num_new_tokens`` of
        them its tokens, the rest lookahead): ``lens += n`` when next read. The caller sets
        ``room``. (``allocate_slots``' decode fast path inlines this.)"""
        self.pending = n
        self._lag += n
        self.num_tokens += num_new_tokens

    def refresh_room(self, block_size: int) -> None:
        """Recompute ``room`` after ``lens`` or ``nblocks`` changed other than by ``+= n``."""
        self.room = int((self.nblocks * block_size - self.lens).min()) if len(self.lens) else 0

    def reserve(self, width: int) -> None:
        """Room for ``width`` table entries per head (the table at least doubles)."""
        if width > self.table.shape[1]:
            grown = np.zeros((self.table.shape[0], max(width, 2 * self.table.shape[1])), np.int32)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown

    def held(self) -> np.ndarray:
        mask = np.arange(self.table.shape[1])[None, :] < self.nblocks[:, None]
        return self.table[mask]


FULL_MAP_LIMIT = 1 << 18  # blocks the dashboard's map reads whole; a bigger pool is sampled
MAP_SAMPLES = 1 << 16  # blocks a sampled map reads (16 per cell of the dashboard's 4,096)


class HeadPagedKVCacheManager(KVCacheManagerBase):
    """Per-(request, layer, KV head) block tables over one pool of one-head blocks per rank
    (see the module docstring). ``num_blocks`` and ``num_host_blocks`` are one rank's pools
    (``spec.num_ranks`` ranks, each with pools of these sizes)."""

    def __init__(
        self,
        spec: HeadPagedSpec,
        num_blocks: int,
        num_host_blocks: int = 0,
        enable_caching: bool = False,
    ) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.num_ranks = ranks = spec.num_ranks
        heads = spec.num_kv_heads * ranks  # H: every rank's KV heads of a layer
        self.num_heads = spec.num_layers * heads  # LH
        self.rank_heads = spec.num_heads_total  # LH / ranks: the heads of one rank's pool
        # head lh = l * H + h is compressible when its layer is
        self.compressible = np.repeat(np.asarray(spec.compressible, dtype=bool), heads)
        # head lh = l * H + r * (H / ranks) + j is rank r's (its blocks are in r's pool)
        self.owner = (np.arange(self.num_heads) % heads) // spec.num_kv_heads
        self.enable_caching = enable_caching
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_cow_copies = 0
        self.num_prefix_copies = 0  # blocks copied so that cached entries outlive an eviction
        self.pool = make_id_pool(num_blocks, ranks)
        self._heads = np.arange(self.num_heads, dtype=np.int64)  # (shared: nobody writes it)
        self._columns: dict[int, np.ndarray] = {}  # ``_column``'s
        # the prefix cache: block hash -> ids [LH] (one block per head); which ids are in an
        # entry; an entry's first id -> its hash; entries no request holds, oldest first
        self.cache: dict[BlockHash, np.ndarray] = {}
        self.in_cache = np.zeros(self.pool.num_blocks, dtype=bool)
        self.is_first = np.zeros(self.pool.num_blocks, dtype=bool)  # an entry's first id
        self.key_of: dict[int, BlockHash] = {}
        self.parked: OrderedDict[BlockHash, None] = OrderedDict()
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.host_pool = make_id_pool(num_host_blocks, ranks) if num_host_blocks else None
        self.states: dict[str, _HeadState] = {}
        self.swapped: dict[str, np.ndarray] = {}  # request -> host ids, in held() order
        self.pending_copies: list[tuple[int, int]] = []
        self.replaced: dict[str, HeadBlocks] = {}
        # KV-Compress statistics
        self.num_compressions = 0
        self.num_evicted_kvs = 0
        self.kept_kvs: dict[str, int] = {}  # request -> compressible KVs after its last eviction

    # ------------------------------------------------------------------ capacity
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / max(1, self.pool.num_blocks)

    def num_free_blocks(self) -> int:
        """Free blocks (of every rank), counting those of cached entries no request holds
        (taken back from the cache, least recently used first, when needed)."""
        return self.pool.num_free + len(self.parked) * self.num_heads

    def _rank_free(self) -> np.ndarray:
        """[ranks] each rank's free blocks (a parked entry holds a block of each head)."""
        return self.pool.free_by_part() + len(self.parked) * self.rank_heads

    def _min_free(self) -> int:
        """The free blocks of the rank with the fewest (all of them on one rank)."""
        if self.num_ranks == 1:
            return self.num_free_blocks()
        return int(self._rank_free().min())

    def _by_rank(self, per_head: np.ndarray) -> np.ndarray:
        """[LH] blocks per head -> [ranks] blocks per rank."""
        return np.bincount(self.owner, weights=per_head, minlength=self.num_ranks).astype(np.int64)

    def _short(self, need: np.ndarray) -> int:
        """Blocks missing from the ranks' pools for ``need`` [ranks] more (0: it fits);
        a rank's spare blocks never make up for another's shortfall.
        Example: free [10, 3], need [4, 5] -> 2."""
        return int(np.maximum(need - self._rank_free(), 0).sum())

    def token_capacity(self) -> int:
        """Tokens one request can hold uncompressed (its prompt is computed before any
        eviction): every token takes one slot in each (layer, KV head)."""
        return (self.pool.num_blocks // self.num_heads) * self.block_size

    def is_idle_clean(self) -> bool:
        return self.num_free_blocks() == self.pool.num_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every cached entry; False (and nothing done) while a request holds one."""
        if len(self.parked) != len(self.cache):
            return False
        while self.parked:
            self._evict_entry(self.parked.popitem(last=False)[0])
        return True

    # ------------------------------------------------------------- block supply
    def _take(self, n: int) -> np.ndarray | None:
        """(One rank.) ``n`` free block ids (refs 1), taking parked cache entries' blocks
        (oldest first) when the stack is short; None (nothing changed) when even they are too
        few."""
        if n > self.num_free_blocks():
            return None
        while self.pool.num_free < n:
            self._evict_entry(self.parked.popitem(last=False)[0])
        return self.pool.take(n)

    def _take_parts(self, parts: np.ndarray) -> np.ndarray | None:
        """A free block id of rank ``parts[i]``'s pool for each entry i (refs 1), taking
        parked cache entries' blocks (oldest first) while a rank's stack is short; None
        (nothing changed) when even they are too few."""
        if self.num_ranks == 1:
            return self._take(len(parts))
        need = np.bincount(parts, minlength=self.num_ranks)
        if np.any(need > self._rank_free()):
            return None
        while np.any(self.pool.free_by_part() < need):
            self._evict_entry(self.parked.popitem(last=False)[0])
        return self.pool.take_parts(parts)

    def _take_heads(self, lh: np.ndarray) -> np.ndarray | None:
        """``_take_parts`` of a block for each head of ``lh`` (from its rank's pool)."""
        if self.num_ranks == 1:
            return self._take(len(lh))
        return self._take_parts(self.owner[lh])

    def _evict_entry(self, key: BlockHash) -> None:
        """Drop a parked entry from the cache: its blocks become free."""
        ids = self.cache.pop(key)
        self._uncache(ids)
        self.pool.push(ids)

    def _uncache(self, ids: np.ndarray) -> None:
        self.in_cache[ids] = False
        self.is_first[ids[0]] = False
        del self.key_of[int(ids[0])]

    def _release(self, ids: np.ndarray) -> None:
        """Drop one reference of each id; blocks of cached entries nobody holds any more are
        parked (still cached), the others freed. The ids are in ``held()`` order (head 0's
        blocks first, in table order), so a request's tail entries are parked first and
        leave the cache first."""
        dead = self.pool.drop(ids)
        if not self.key_of or len(dead) == 0:
            self.pool.push(dead)
            return
        cached = self.in_cache[dead]
        self.pool.push(dead[~cached])
        for i in dead[self.is_first[dead]][::-1].tolist():
            self.parked[self.key_of[i]] = None

    def _blocks_for(self, state: _HeadState | None, num_new: int) -> np.ndarray:
        """New blocks per head for ``num_new`` more tokens (the module docstring's rule)."""
        if state is None:
            return np.full(self.num_heads, cdiv(num_new, self.block_size), dtype=np.int64)
        need = -(-(state.lens + num_new) // self.block_size) - state.nblocks
        return np.maximum(need, 0)

    def _num_blocks_for(self, state: _HeadState | None, num_new: int) -> int:
        """``_blocks_for(...).sum()``; 0 at once when every head has room."""
        if state is not None and num_new <= state.room:
            return 0
        return int(self._blocks_for(state, num_new).sum())

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a request holding none takes for its first ``num_tokens`` tokens (every
        head's). Example: bs 16, 256 heads, 8,000 tokens -> 500 x 256."""
        return self._num_blocks_for(None, num_tokens)

    def blocks_short(self, request: Request, num_new: int) -> int:
        """Blocks missing from the pools for ``num_new`` more tokens of the request (0: it
        fits)."""
        state = self.states.get(request.request_id)
        if state is not None and num_new <= state.room:
            return 0
        return self._missing(self._blocks_for(state, num_new))

    def _missing(
        self, per_head: np.ndarray, extra: np.ndarray | None = None, entries: int = 0
    ) -> int:
        """Blocks missing from the pools for ``per_head`` [LH] new blocks, ``extra``
        [ranks] more, and ``entries`` parked cache entries taken back (each a block of every
        head); 0: they fit. With several ranks each rank's pool must hold its heads' blocks
        (``_short``)."""
        if self.num_ranks == 1:
            need = int(per_head.sum()) + entries * self.num_heads
            if extra is not None:
                need += int(extra.sum())
            return max(need - self.num_free_blocks(), 0)
        need = self._by_rank(per_head) + entries * self.rank_heads
        return self._short(need if extra is None else need + extra)

    def _shared_mask(self, state: _HeadState) -> np.ndarray:
        """[LH, width] the fork-shared blocks a request must copy before writing: held, held
        by another request too, and past its protected cached prefix."""
        cols = np.arange(state.table.shape[1])[None, :]
        held = (cols >= state.prefix_blocks) & (cols < state.nblocks[:, None])
        return held & (self.pool.ref[state.table] > 1)

    def _copy_need(self, state: _HeadState | None) -> np.ndarray | int:
        """[LH] blocks a request holding shared blocks needs per head for its private copies
        (0: none)."""
        if state is None or not state.shared:
            return 0
        return self._shared_mask(state).sum(1)

    def can_allocate(self, request: Request, budget: int) -> bool:
        rid = request.request_id
        state = self.states.get(rid)
        if state is None and not request.swapped:
            hit = self._lookup(request)
            start = len(hit) * self.block_size
            chunk = min(request.num_tokens - start, budget)
            parked = sum(key in self.parked for key in hit)
            return not self._missing(self._blocks_for(None, chunk), entries=parked)
        chunk = min(request.num_tokens - request.num_computed_tokens, budget)
        need = self._blocks_for(state, chunk)
        # a swapped request first needs its blocks back; a fork, copies of the shared ones
        if request.swapped:
            assert self.host_pool is not None
            back = self.host_pool.part_of(self.swapped[rid])
            return not self._missing(need, np.bincount(back, minlength=self.num_ranks))
        return not self._missing(need + self._copy_need(state))

    # -------------------------------------------------------------- prefix cache
    def _hashes(self, request: Request) -> list[BlockHash]:
        """The chained hashes of the request's full blocks (kept until it is freed, extended
        as it grows)."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        return hash_request_blocks(
            request.all_token_ids, self.block_size, hashes, block_hash_extra(request)
        )

    def _lookup(self, request: Request) -> list[BlockHash]:
        """The cached entries that start the request's tokens (at most ``num_tokens - 1``
        tokens: the last is always computed, for its logits)."""
        if not self.uses_prefix_cache(request) or not self.cache:
            return []
        hit = []
        for key in self._hashes(request)[: (request.num_tokens - 1) // self.block_size]:
            if key not in self.cache:
                break
            hit.append(key)
        return hit

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Tokens a prefix hit would give the request now (no side effects)."""
        return len(self._lookup(request)) * self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[BlockHash], int]:
        """The cached entries that start the request (for ``allocate_slots``) and the tokens
        they hold."""
        hit = self._lookup(request)
        return hit, len(hit) * self.block_size

    def _register(self, request: Request, state: _HeadState) -> None:
        """Cache the request's blocks that are full of known tokens (every head holds the same
        tokens until its first eviction). A block whose hash another request's entry already
        has stays private."""
        if state.frozen or not self.uses_prefix_cache(request):
            return
        num_full = min(state.num_tokens, request.num_tokens) // self.block_size
        if num_full <= state.registered:
            return
        hashes = self._hashes(request)
        for i in range(state.registered, num_full):
            key = hashes[i]
            if key in self.cache:
                continue
            ids = state.table[:, i].astype(np.int64)
            self.cache[key] = ids
            self.in_cache[ids] = True
            self.is_first[ids[0]] = True
            self.key_of[int(ids[0])] = key
        state.registered = num_full

    def settle_prefix(self, request: Request) -> int:
        """Before an eviction is planned: the request's protected prefix (tokens). Its
        registered blocks that another request also holds (a prefix hit on them) join it, and
        it registers nothing more. Its other registered blocks stay cached until
        ``detach_own`` (right before an eviction rewrites them).

        Example: bs 16, a hit of 2 blocks still held by the request it came from, blocks 2-5
        registered by the request, block 2 also held by a later request -> prefix 3 blocks (48
        tokens); blocks 3-5 its own. Once the others are gone, its prefix is 0 blocks at its
        next eviction: all are its own, compressed like the rest."""
        state = self.states.get(request.request_id)
        if state is None:
            return 0
        state.prefix_blocks = k = self._shared_run(state)
        state.frozen = True
        return k * self.block_size

    def _shared_run(self, state: _HeadState) -> int:
        """The leading cached blocks of the request that another request holds too (shared
        now: a block only this request holds, even one it got from a hit, is its own)."""
        k, ref, first = 0, self.pool.ref, state.table[0]
        while k < state.registered and self.in_cache[first[k]] and ref[first[k]] > 1:
            k += 1
        return k

    def detach_own(
        self, request: Request, keep_cached: bool = False
    ) -> tuple[HeadBlocks, np.ndarray] | None:
        """Before the request's blocks are rewritten (an eviction, a fork): its registered
        blocks past its protected prefix leave its table's care. With ``keep_cached`` and
        enough free blocks (parked ones not counted), the request moves to private copies and
        the cached entries stay (parked, for a later request with the same prefix: a system
        prompt served one request at a time); returns (its table's new entries, the ids they
        copy), which the runner copies after the step's forward pass and before the eviction.
        Otherwise the entries leave the cache; returns None.

        Example: LH 2, prefix 1 block, blocks 1-2 its own cached ones ([[7, 8], [9, 10]] in
        heads 0 and 1), 4 free -> new ids [[20, 21], [22, 23]]: table entries (lh 0, index 1)
        = 20 ... (lh 1, index 2) = 23, copying 7, 8, 9, 10; entries 7/9 and 8/10 parked."""
        state = self.states.get(request.request_id)
        if state is None:
            return None
        first = state.table[0]
        own = [i for i in range(state.prefix_blocks, state.registered) if self.in_cache[first[i]]]
        state.registered = state.prefix_blocks
        if not own:
            return None
        index = np.asarray(own, dtype=np.int64)
        m, lh = len(own), self.num_heads
        # copies come from free blocks only, never from other parked entries: under memory
        # pressure the entries simply leave the cache (no churn of copies evicting copies)
        heads = np.repeat(np.arange(lh), m)
        dst = self.pool.take_parts(self.owner[heads]) if keep_cached else None
        if dst is None:
            for i in own:
                self._uncache(self.cache.pop(self.key_of[int(first[i])]))
            return None
        src = state.table[:, index].astype(np.int64)  # [LH, m]
        dst = dst.astype(np.int64).reshape(lh, m)
        state.table[:, index] = dst
        self._release(src.reshape(-1))  # cached: parked
        self.num_prefix_copies += m * lh
        blocks = HeadBlocks(heads, np.tile(index, lh), dst.reshape(-1))
        return blocks, src.reshape(-1)

    def prefix_tokens(self, request_id: str) -> int:
        """Tokens of the request's cached prefix shared now (what ``settle_prefix`` would
        protect)."""
        state = self.states.get(request_id)
        return 0 if state is None else self._shared_run(state) * self.block_size

    # ---------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: object = None,
        num_lookahead_tokens: int = 0,
    ) -> HeadBlocks | None:
        """Room for ``num_new_tokens`` (+ lookahead) more KVs in every head, after the cached
        entries ``new_computed_blocks`` of a prefix hit (a new request); the new table entries,
        or None (nothing changed) when the pool is short. A request holding shared blocks (a
        fork) first gets private copies of them."""
        rid = request.request_id
        state = self.states.get(rid)
        n = num_new_tokens + num_lookahead_tokens
        if state is not None and n <= state.room and not state.shared:  # most decode steps
            state.pending = n  # (``add_tokens``, inlined: the commonest call of a step)
            state._lag += n  # lens += n, applied when lens is next read
            state.num_tokens += num_new_tokens
            state.room -= n
            return _NO_BLOCKS
        if state is not None and not state.shared:
            if state.uniform:
                return self._allocate_uniform(request, state, num_new_tokens, n)
            if n <= self.block_size:
                return self._allocate_a_block_or_none(request, state, num_new_tokens, n)
        # a hit of whole blocks needs, per head, the blocks of n tokens after it, as no hit
        need = self._blocks_for(state, n)
        total = int(need.sum())
        copies = self._copy_need(state)
        hit: list = list(new_computed_blocks or []) if state is None else []
        parked = sum(key in self.parked for key in hit)
        if self._missing(need + copies, entries=parked):
            return None
        if state is None:
            max_blocks = cdiv(max(request.num_tokens, 1) + n, self.block_size) + 1
            state = self.states[rid] = _HeadState(self.num_heads, max_blocks)
            if hit:
                self._attach_hit(request, state, hit)
        if np.any(copies):
            self._unshare(rid, state)
        else:
            state.shared = False  # its siblings are gone (or hold only its cached prefix)
        state.pending = n
        if total == 0:
            state.lens += n
            state.num_tokens += num_new_tokens
            state.refresh_room(self.block_size)
            self._register(request, state)
            return _NO_BLOCKS
        # Example: need [0, 2, 1], nblocks [3, 1, 4] -> lh [1, 1, 2], index [1, 2, 4]
        lh = np.repeat(np.arange(self.num_heads), need)
        ids = self._take_heads(lh)
        assert ids is not None
        state.reserve(int((state.nblocks + need).max()))
        offsets = np.arange(total) - np.repeat(np.cumsum(need) - need, need)
        index = state.nblocks[lh] + offsets
        state.table[lh, index] = ids
        state.nblocks += need
        state.lens += n
        state.num_tokens += num_new_tokens
        state.refresh_room(self.block_size)
        self._register(request, state)
        return HeadBlocks(lh, index, ids.astype(np.int64))

    def _allocate_uniform(
        self, request: Request, state: _HeadState, num_new_tokens: int, n: int
    ) -> HeadBlocks | None:
        """``allocate_slots`` for a request whose heads all hold the same KVs and blocks (never
        evicted from) and that shares none: the same number of new blocks for every head, by
        scalar arithmetic (the per-head arrays cost ~20 numpy calls a request, and a decode
        step of 256 requests has ~16 such requests at a block boundary).

        Example: bs 16, LH 2, every head 32 KVs in 2 blocks, n 1 -> 1 new block per head at
        column 2: ids [a, b] -> table[0, 2] = a, table[1, 2] = b; room 15."""
        bs, heads = self.block_size, self.num_heads
        # (scalars of head 0: every head holds the same; ``_lens`` less its pending lag)
        nb, length = int(state.nblocks[0]), int(state._lens[0]) + state._lag
        need = max(-(-(length + n) // bs) - nb, 0)
        if need * self.rank_heads > self._min_free():  # (every rank needs as many)
            return None
        state.add_tokens(n, num_new_tokens)
        state.room = (nb + need) * bs - (length + n)
        if need == 0:
            self._register(request, state)
            return _NO_BLOCKS
        if self.num_ranks > 1:  # each head's blocks from its rank's pool
            ids = self._take_heads(self._heads if need == 1 else np.repeat(self._heads, need))
        else:  # (the stack first: _take's check of parked cache entries is for a short stack)
            ids = self.pool.take(need * heads) if need * heads <= self.pool.num_free else None
            if ids is None:
                ids = self._take(need * heads)
        assert ids is not None
        state.reserve(nb + need)
        if need == 1:  # a decode step's block: one column of every head
            state.table[:, nb] = ids
            lh, index = self._heads, self._column(nb)
        else:
            state.table[:, nb : nb + need] = ids.reshape(heads, need)
            lh = np.repeat(self._heads, need)
            index = np.tile(np.arange(nb, nb + need, dtype=np.int64), heads)
        state.nblocks += need
        self._register(request, state)
        return HeadBlocks(lh, index, ids.astype(np.int64))

    def _allocate_a_block_or_none(
        self, request: Request, state: _HeadState, num_new_tokens: int, n: int
    ) -> HeadBlocks | None:
        """``allocate_slots`` for at most a block's tokens (``n <= bs``) of a request whose
        heads differ (evicted from) and that shares none: each head needs one new block when
        its last block has fewer than ``n`` free slots, none otherwise (no per-head block
        counts to expand; a decode step of a compressed request at a block boundary of some
        of its heads, the commonest allocation under KV-Compress).

        Example: bs 4, lens [5, 8, 3], nblocks [2, 2, 1], n 1 -> free [3, 0, 1] -> head 1
        takes a block at column 2; free then [3, 4, 1], room min(...) - n = 0."""
        bs = self.block_size
        free = state.nblocks * bs - state.lens  # [LH] free slots in each head's last block
        lh = np.flatnonzero(free < n)
        ids = self._take_heads(lh)
        if ids is None:
            return None
        index = state.nblocks[lh]
        if len(lh):
            state.reserve(int(index.max()) + 1)
        state.table[lh, index] = ids
        state.nblocks[lh] += 1
        free[lh] += bs
        state.add_tokens(n, num_new_tokens)
        state.room = int(free.min()) - n
        self._register(request, state)
        return HeadBlocks(lh, index, ids.astype(np.int64))

    def _column(self, index: int) -> np.ndarray:
        """[LH] int64 all ``index`` (shared, cached by index: nobody writes them)."""
        col = self._columns.get(index)
        if col is None:
            col = self._columns[index] = np.full(self.num_heads, index, dtype=np.int64)
        return col

    def _attach_hit(self, request: Request, state: _HeadState, hit: list[BlockHash]) -> None:
        """A new request's table starts with the hit entries' blocks (one more reference
        each; parked entries are taken back from the LRU)."""
        k = len(hit)
        ids = np.stack([self.cache[key] for key in hit], axis=1)  # [LH, k]
        for key in hit:
            self.parked.pop(key, None)
        self.pool.ref[ids.reshape(-1)] += 1
        state.table[:, :k] = ids
        state.nblocks[:] = k
        state.lens = np.full(self.num_heads, k * self.block_size, dtype=np.int64)
        state.num_tokens = k * self.block_size
        state.prefix_blocks = state.registered = k

    def _unshare(self, rid: str, state: _HeadState) -> None:
        """Copy every block this request shares into a private one (copy-on-write)."""
        lh, index = np.nonzero(self._shared_mask(state))
        src = state.table[lh, index].astype(np.int64)
        dst = self._take_heads(lh)
        assert dst is not None
        self._release(src)
        state.table[lh, index] = dst
        self.pending_copies.extend(zip(src.tolist(), dst.tolist()))
        self.num_cow_copies += len(src)
        prev = self.replaced.get(rid)
        new = HeadBlocks(lh.astype(np.int64), index.astype(np.int64), dst.astype(np.int64))
        if prev is not None:
            new = HeadBlocks(
                *(
                    np.concatenate([a, b])
                    for a, b in zip((prev.lh, prev.index, prev.ids), (new.lh, new.index, new.ids))
                )
            )
        self.replaced[rid] = new
        state.shared = False

    def new_block_ids(self, new_blocks: Sequence) -> tuple:
        if new_blocks is _NO_BLOCKS or new_blocks is None:  # (most steps: no HeadBlocks.len)
            return ()
        return (new_blocks,) if len(new_blocks) else ()

    def block_columns(self, request_id: str, first: int, n: int) -> np.ndarray:
        """[n, LH] the blocks ``first .. first + n - 1`` of every head of a request whose heads
        still hold the same tokens (never evicted from: prefill/decode disaggregation moves
        them as rows, ``core/kv_transfer/``). Example: bs 16, first 2, n 1 -> each head's
        block holding tokens 32..47."""
        state = self.states[request_id]
        assert int(state.nblocks.min()) >= first + n and state.uniform, request_id
        return state.table[:, first : first + n].T.copy()

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The chained hashes of the request's full blocks of known tokens (the prefix
        cache's keys; the host tier's too)."""
        return self._hashes(request)

    def cached_ids(self, key: BlockHash) -> np.ndarray | None:
        """[LH] the blocks of the prefix cache's entry ``key`` (one per (layer, KV head)), or
        None when the device cache does not hold it."""
        return self.cache.get(key)

    def count_loaded(self, request_id: str, num_tokens: int) -> None:
        """The first ``num_tokens`` tokens the request's latest allocation made room for hold
        their KVs already (a KV connector loads them before the step): the table the runner
        gets (``get_block_table``) counts them as computed."""
        self.states[request_id].pending -= num_tokens

    def fits_first(self, request: Request, num_tokens: int) -> bool:
        """Whether a request not yet admitted finds blocks in every head for ``num_tokens``
        tokens after its prefix hit (the hit's parked entries taken back count)."""
        hit = self._lookup(request)
        parked = sum(key in self.parked for key in hit)
        return not self._missing(self._blocks_for(None, num_tokens), entries=parked)

    def get_block_table(self, request_id: str) -> tuple:
        """The whole table, with the KVs per head computed before the step being scheduled:
        (``HeadTable``,)."""
        state = self.states.get(request_id)
        if state is None:
            return (HeadTable(np.zeros((self.num_heads, 0), np.int32), np.zeros(self.num_heads)),)
        table = state.table[:, : int(state.nblocks.max())].copy()
        return (HeadTable(table, state.lens - state.pending),)

    def computed_lens(self, request: Request, state: _HeadState | None = None) -> np.ndarray:
        """KVs per head whose K/V exist: ``lens`` less the tokens allocated but not yet
        computed."""
        state = state or self.states[request.request_id]
        return state.lens - (state.num_tokens - request.num_computed_tokens)

    def block_map(
        self, full_limit: int = FULL_MAP_LIMIT, samples: int = MAP_SAMPLES
    ) -> BlockMap:
        """Every one-head block of every rank's pool: held by a request's table, parked in
        the prefix cache (no request holds it), or free. A pool of more than ``full_limit``
        blocks (a GPU's: millions) is sampled at a stride (about ``samples`` blocks) from the
        ref counts, with exact counts (one pass over the ref counts) and no owners."""
        n = self.pool.num_blocks
        if n <= full_limit:
            tables = ((rid, st.held()) for rid, st in self.states.items())
            return build_block_map(n, tables, np.flatnonzero(self.in_cache))
        stride = -(-n // samples)
        ref = self.pool.ref[::stride]  # [n / stride] tables holding each sampled block
        state = np.where(self.in_cache[::stride], CACHED, FREE).astype(np.uint8)
        state[ref == 1] = USED
        state[ref > 1] = SHARED
        cached = len(self.parked) * self.num_heads
        shared = int(np.count_nonzero(self.pool.ref > 1))
        free = self.pool.num_free
        counts = {"free": free, "cached": cached, "used": n - free - cached - shared,
                  "shared": shared, "reserved": 0}  # fmt: skip
        ids = tuple(self.states)
        held = np.array([int(st.nblocks.sum()) for st in self.states.values()], dtype=np.int64)
        owner = np.full(len(state), -1, dtype=np.int32)
        return BlockMap(state, owner, ids, held, stride, n, counts)

    def head_lens(self, request_id: str) -> np.ndarray | None:
        """[layers, H] the KVs each (layer, KV head) of the request holds (H: every rank's
        KV heads), or None when it holds none."""
        state = self.states.get(request_id)
        if state is None:
            return None
        return state.lens.reshape(self.spec.num_layers, -1)

    def held_kvs(self, request_id: str) -> int:
        """KVs the request holds in compressible heads after its protected cached prefix
        (what its budget counts)."""
        state = self.states.get(request_id)
        if state is None:
            return 0
        prefix = self.prefix_tokens(request_id) * int(self.compressible.sum())
        return int(state.lens[self.compressible].sum()) - prefix

    def head_extent(self, request_id: str) -> tuple[int, int]:
        """(the longest head's KVs, ``held_kvs``) of a request, as allocated."""
        state = self.states.get(request_id)
        if state is None:
            return 0, 0
        return int(state.lens.max()), self.held_kvs(request_id)

    def free(self, request: Request) -> None:
        rid = request.request_id
        self.req_hashes.pop(rid, None)
        state = self.states.pop(rid, None)
        if state is not None:
            self._release(state.held().astype(np.int64))
        host = self.swapped.pop(rid, None)
        if host is not None and self.host_pool is not None:
            self.host_pool.release(host)
        self.replaced.pop(rid, None)
        self.kept_kvs.pop(rid, None)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent; each copies the shared blocks past
        their protected cached prefix into private ones at its next allocation. The parent's
        prefix is settled first (``settle_prefix``): neither registers more blocks."""
        src = self.states.get(parent.request_id)
        if src is None:
            return
        self.settle_prefix(parent)
        self.detach_own(parent)
        state = _HeadState(self.num_heads, src.table.shape[1])
        state.prefix_blocks = state.registered = src.prefix_blocks
        state.frozen = True
        state.table[:] = src.table
        state.nblocks[:] = src.nblocks
        state.lens[:] = src.lens
        state.uniform = src.uniform
        state.num_tokens = src.num_tokens
        state.room = src.room
        held = state.held().astype(np.int64)
        np.add.at(self.pool.ref, held, 1)
        state.shared = src.shared = len(held) > 0
        self.states[child.request_id] = state

    def take_replaced(self, request_id: str) -> list:
        r = self.replaced.pop(request_id, None)
        return [] if r is None else [r]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ------------------------------------------------------------------ eviction
    def apply_compaction(
        self, request: Request, lens: np.ndarray, computed: int | None = None
    ) -> int:
        """The runner evicted KVs: ``lens`` [LH] are the KVs left per head of the request's
        first ``computed`` tokens (default: its computed tokens now). Tokens allocated after
        those (a step scheduled before the lengths came back) add one KV to every head. Give
        back the blocks past the new lengths; returns the number of blocks freed.

        Example: bs 4, an eviction after token 20 leaves a head 6 KVs; the next step (token
        21) was scheduled meanwhile -> that head holds 7 KVs in 2 blocks; its others go."""
        state = self.states.get(request.request_id)
        if state is None:
            return 0
        if computed is None:
            computed = request.num_computed_tokens
        uncomputed = state.num_tokens - computed
        before = int(state.lens[self.compressible].sum())
        new_lens = lens.astype(np.int64) + uncomputed
        keep = -(-new_lens // self.block_size)
        cols = np.arange(state.table.shape[1])[None, :]
        gone = (cols >= keep[:, None]) & (cols < state.nblocks[:, None])
        freed = state.table[gone].astype(np.int64)
        self._release(freed)
        state.nblocks = np.minimum(state.nblocks, keep)
        state.lens = new_lens
        state.uniform = False
        state.refresh_room(self.block_size)
        after = int(state.lens[self.compressible].sum())
        self.num_compressions += 1
        self.num_evicted_kvs += before - after
        self.kept_kvs[request.request_id] = after
        return len(freed)

    def drop_last(self, request: Request, num_tokens: int) -> int:
        """The request's last ``num_tokens`` computed tokens were taken back (speculative
        decoding: the KVs of its rejected drafts): every head drops its last ``num_tokens``
        KVs, and the blocks past the new lengths go back. Returns the number of blocks freed.

        A step's KVs are the last ones of every head until an eviction after the step; the
        planner (``core/sched/kvc.py``) runs no eviction between a step that verifies drafts
        and this call, so the dropped KVs are exactly the rejected drafts'. Prefix-cache
        entries are never among them: a request registers only blocks full of known tokens.

        Example: bs 4, lens [6, 9] in 2 and 3 blocks, 3 dropped -> lens [3, 6]: head 0's
        second block and head 1's third go back."""
        state = self.states.get(request.request_id)
        if state is None or num_tokens <= 0:
            return 0
        lens = state.lens - num_tokens
        assert lens.min() >= 0
        assert state.registered * self.block_size <= request.num_computed_tokens
        keep = -(-lens // self.block_size)
        cols = np.arange(state.table.shape[1])[None, :]
        gone = (cols >= keep[:, None]) & (cols < state.nblocks[:, None])
        freed = state.table[gone].astype(np.int64)
        self._release(freed)
        state.nblocks = np.minimum(state.nblocks, keep)
        state.lens = lens
        state.num_tokens -= num_tokens
        state.refresh_room(self.block_size)
        return len(freed)

    # ---------------------------------------------------------------------- swap
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        rid = request.request_id
        state = self.states.get(rid)
        if state is None or self.host_pool is None:
            return None
        held = state.held().astype(np.int64)
        if np.any(self.pool.ref[held] > 1):
            return None  # shared blocks stay on the device: recompute instead
        # (a rank's blocks go to its own host pool)
        host = self.host_pool.take_parts(self.pool.part_of(held))
        if host is None:
            return None
        self._release(held)  # cached entries among them stay cached (parked)
        state.frozen = True  # it comes back in other blocks
        self.swapped[rid] = host.astype(np.int64)
        return list(zip(held.tolist(), host.tolist()))

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        rid = request.request_id
        state = self.states[rid]
        host = self.swapped[rid]
        assert self.host_pool is not None
        dev = self._take_parts(self.host_pool.part_of(host))
        if dev is None:
            return None
        cols = np.arange(state.table.shape[1])[None, :]
        state.table[cols < state.nblocks[:, None]] = dev  # held() order
        del self.swapped[rid]
        self.host_pool.release(host)
        return list(zip(host.tolist(), dev.astype(np.int64).tolist()))

    # --------------------------------------------------------------------- checks
    def check_integrity(self) -> None:
        """Every block's ref count equals the tables holding it; free + used == total; each
        head's blocks cover its KVs and (several ranks) are its rank's."""
        live = [s for rid, s in self.states.items() if rid not in self.swapped]
        held = np.concatenate([s.held() for s in live]) if live else np.zeros(0, np.int32)
        self.pool.check(held.astype(np.int64), len(self.parked) * self.num_heads)
        assert int(self.in_cache.sum()) == len(self.cache) * self.num_heads
        assert len(self.key_of) == len(self.cache) == int(self.is_first.sum())
        for key, ids in self.cache.items():
            assert self.key_of[int(ids[0])] == key and self.in_cache[ids].all()
            assert np.all(self.pool.ref[ids] == 0) == (key in self.parked), "parked != unheld"
        for rid, s in self.states.items():
            assert np.all(s.nblocks == -(-s.lens // self.block_size)), "blocks != cdiv(lens)"
            room = int((s.nblocks * self.block_size - s.lens).min()) if len(s.lens) else 0
            assert s.room == room, f"room {s.room} != {room}"
            if s.uniform:
                assert np.all(s.lens == s.lens[0]) and np.all(s.nblocks == s.nblocks[0])
            if self.num_ranks > 1 and rid not in self.swapped:
                cols = np.arange(s.table.shape[1])[None, :] < s.nblocks[:, None]
                heads = np.broadcast_to(self._heads[:, None], s.table.shape)[cols]
                assert np.array_equal(self.pool.part_of(s.table[cols]), self.owner[heads]), (
                    "a head holds a block of another rank's pool"
                )
        if self.host_pool is not None:
            hosts = list(self.swapped.values())
            self.host_pool.check(np.concatenate(hosts) if hosts else np.zeros(0, np.int64))
