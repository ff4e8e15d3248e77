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
scores are: the scheduler asks for it in ``SchedulerOutput.kvc_compress``, the runner compacts
every evicted head's survivors into its first blocks and returns the new per-head lengths, and
``apply_compaction`` gives back the blocks past them.

Decisions (see docs/ARCHITECTURE.md, "KV-Compress"):
- No prefix cache: a compressing request takes no shared blocks (its prompt KVs are rewritten
  by compaction). ``enable_caching`` is off whatever the engine's flag.
- Forks (n > 1) share the parent's blocks (ref counts); a request holding shared blocks copies
  them all into private ones at its next allocation (``take_pending_copies``), so each sequence
  then compresses its own blocks.
- Swap preemption copies a request's blocks to host blocks and back into new device blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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


class _IdPool:
    """Block ids with reference counts and a stack of free ids."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)  # pops 0, 1, 2 ...
        self.num_free = num_blocks

    def take(self, n: int) -> np.ndarray | None:
        if n > self.num_free:
            return None
        ids = self.stack[self.num_free - n : self.num_free][::-1].copy()
        self.num_free -= n
        self.ref[ids] = 1
        return ids

    def release(self, ids: np.ndarray) -> None:
        """Drop one reference of each id (distinct ids: the blocks of one request's table);
        ids at 0 go back on the stack."""
        if len(ids) == 0:
            return
        self.ref[ids] -= 1
        dead = ids[self.ref[ids] == 0]
        self.stack[self.num_free : self.num_free + len(dead)] = dead[::-1]
        self.num_free += len(dead)

    def check(self, held: np.ndarray) -> None:
        refs = np.bincount(held, minlength=self.num_blocks)
        assert np.array_equal(self.ref, refs), (
            "a block's ref count differs from the tables holding it"
        )
        free = self.stack[: self.num_free]
        assert len(np.unique(free)) == self.num_free, "a block is free twice"
        assert not np.any(self.ref[free]), "a free block is referenced"
        assert int((self.ref > 0).sum()) + self.num_free == self.num_blocks


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

    def refresh_room(self, block_size: int) -> None:
        """Recompute ``room`` after ``lens`` or ``nblocks`` changed other than by ``+= n``."""
        self.room = int((self.nblocks * block_size - self.lens).min()) if len(self.lens) else 0

    def held(self) -> np.ndarray:
        mask = np.arange(self.table.shape[1])[None, :] < self.nblocks[:, None]
        return self.table[mask]


class HeadPagedKVCacheManager(KVCacheManagerBase):
    """Per-(request, layer, KV head) block tables over one pool of one-head blocks (see the
    module docstring)."""

    def __init__(self, spec: HeadPagedSpec, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.num_heads = spec.num_heads_total  # LH
        # head lh = l * H + h is compressible when its layer is
        self.compressible = np.repeat(np.asarray(spec.compressible, dtype=bool), spec.num_kv_heads)
        self.enable_caching = False
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_cow_copies = 0
        self.pool = _IdPool(num_blocks)
        self.host_pool = _IdPool(num_host_blocks) if num_host_blocks else None
        self.states: dict[str, _HeadState] = {}
        self.swapped: dict[str, np.ndarray] = {}  # request -> host ids, in held() order
        self.pending_copies: list[tuple[int, int]] = []
        self.replaced: dict[str, HeadBlocks] = {}
        # KV-Compress statistics
        self.num_compressions = 0
        self.num_evicted_kvs = 0
        self.kept_kvs: dict[str, int] = {}  # request -> compressible KVs after its last eviction
        # set to a list to record (request id, KVs before, KVs after) of every eviction
        # (benchmarks read it; the engine never sets it)
        self.eviction_log: list[tuple[str, int, int]] | None = None

    # ------------------------------------------------------------------ capacity
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / max(1, self.pool.num_blocks)

    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def token_capacity(self) -> int:
        """Tokens one request can hold uncompressed (its prompt is computed before any
        eviction): every token takes one slot in each (layer, KV head)."""
        return (self.pool.num_blocks // self.num_heads) * self.block_size

    def is_idle_clean(self) -> bool:
        return self.pool.num_free == self.pool.num_blocks

    def reset_prefix_cache(self) -> bool:
        return True  # nothing is ever cached

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

    def blocks_short(self, request: Request, num_new: int) -> int:
        """Blocks missing from the pool for ``num_new`` more tokens of the request (0: it
        fits)."""
        need = self._num_blocks_for(self.states.get(request.request_id), num_new)
        return max(need - self.pool.num_free, 0)

    def _copy_need(self, state: _HeadState | None) -> int:
        """Blocks a request holding shared blocks needs for its private copies."""
        if state is None or not state.shared:
            return 0
        held = state.held()
        return int((self.pool.ref[held] > 1).sum())

    def can_allocate(self, request: Request, budget: int) -> bool:
        rid = request.request_id
        state = self.states.get(rid)
        chunk = min(request.num_tokens - request.num_computed_tokens, budget)
        need = self._num_blocks_for(state, chunk)
        # a swapped request first needs its blocks back; a fork, copies of the shared ones
        need += len(self.swapped[rid]) if request.swapped else self._copy_need(state)
        return need <= self.pool.num_free

    # -------------------------------------------------------------- prefix cache
    def num_cached_prefix_tokens(self, request: Request) -> int:
        return 0

    def get_computed_blocks(self, request: Request) -> tuple[None, int]:
        return None, 0

    # ---------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: object = None,
        num_lookahead_tokens: int = 0,
    ) -> HeadBlocks | None:
        """Room for ``num_new_tokens`` (+ lookahead) more KVs in every head; the new table
        entries, or None (nothing changed) when the pool is short. A request holding shared
        blocks (a fork) first gets private copies of them."""
        rid = request.request_id
        state = self.states.get(rid)
        n = num_new_tokens + num_lookahead_tokens
        if state is not None and n <= state.room and not state.shared:  # most decode steps
            state.pending = n
            state._lag += n  # lens += n, applied when lens is next read
            state.num_tokens += num_new_tokens
            state.room -= n
            return _NO_BLOCKS
        need = self._blocks_for(state, n)
        total = int(need.sum())
        copies = self._copy_need(state)
        if total + copies > self.pool.num_free:
            return None
        if state is None:
            max_blocks = cdiv(max(request.num_tokens, 1) + n, self.block_size) + 1
            state = self.states[rid] = _HeadState(self.num_heads, max_blocks)
        if copies:
            self._unshare(rid, state)
        state.pending = n
        if total == 0:
            state.lens += n
            state.num_tokens += num_new_tokens
            state.refresh_room(self.block_size)
            return _NO_BLOCKS
        ids = self.pool.take(total)
        assert ids is not None
        width = int((state.nblocks + need).max())
        if width > state.table.shape[1]:
            grown = np.zeros((self.num_heads, max(width, 2 * state.table.shape[1])), np.int32)
            grown[:, : state.table.shape[1]] = state.table
            state.table = grown
        # Example: need [0, 2, 1], nblocks [3, 1, 4] -> lh [1, 1, 2], index [1, 2, 4]
        lh = np.repeat(np.arange(self.num_heads), need)
        offsets = np.arange(total) - np.repeat(np.cumsum(need) - need, need)
        index = state.nblocks[lh] + offsets
        state.table[lh, index] = ids
        state.nblocks += need
        state.lens += n
        state.num_tokens += num_new_tokens
        state.refresh_room(self.block_size)
        return HeadBlocks(lh, index, ids.astype(np.int64))

    def _unshare(self, rid: str, state: _HeadState) -> None:
        """Copy every block this request shares into a private one (copy-on-write)."""
        cols = np.arange(state.table.shape[1])[None, :]
        held = cols < state.nblocks[:, None]
        shared = held & (self.pool.ref[state.table] > 1)
        lh, index = np.nonzero(shared)
        src = state.table[lh, index].astype(np.int64)
        dst = self.pool.take(len(src))
        assert dst is not None
        self.pool.release(src)
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
        return (new_blocks,) if new_blocks is not None and len(new_blocks) else ()

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

    def held_kvs(self, request_id: str) -> int:
        """KVs the request holds in compressible heads (what its budget counts)."""
        state = self.states.get(request_id)
        return 0 if state is None else int(state.lens[self.compressible].sum())

    def head_extent(self, request_id: str) -> tuple[int, int]:
        """(the longest head's KVs, KVs in compressible heads) of a request, as allocated."""
        state = self.states.get(request_id)
        if state is None:
            return 0, 0
        return int(state.lens.max()), int(state.lens[self.compressible].sum())

    def free(self, request: Request) -> None:
        rid = request.request_id
        state = self.states.pop(rid, None)
        if state is not None:
            self.pool.release(state.held().astype(np.int64))
        host = self.swapped.pop(rid, None)
        if host is not None and self.host_pool is not None:
            self.host_pool.release(host)
        self.replaced.pop(rid, None)
        self.kept_kvs.pop(rid, None)

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent; each copies the shared blocks into
        private ones at its next allocation."""
        src = self.states.get(parent.request_id)
        if src is None:
            return
        state = _HeadState(self.num_heads, src.table.shape[1])
        state.table[:] = src.table
        state.nblocks[:] = src.nblocks
        state.lens[:] = src.lens
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
    def apply_compaction(self, request: Request, lens: np.ndarray) -> int:
        """The runner evicted KVs: ``lens`` [LH] are the computed KVs left per head. Give back
        the blocks past them; returns the number of blocks freed."""
        state = self.states.get(request.request_id)
        if state is None:
            return 0
        uncomputed = state.num_tokens - request.num_computed_tokens
        before = int(state.lens[self.compressible].sum())
        new_lens = lens.astype(np.int64) + uncomputed
        keep = -(-new_lens // self.block_size)
        cols = np.arange(state.table.shape[1])[None, :]
        gone = (cols >= keep[:, None]) & (cols < state.nblocks[:, None])
        freed = state.table[gone].astype(np.int64)
        self.pool.release(freed)
        state.nblocks = np.minimum(state.nblocks, keep)
        state.lens = new_lens
        state.refresh_room(self.block_size)
        after = int(state.lens[self.compressible].sum())
        self.num_compressions += 1
        self.num_evicted_kvs += before - after
        self.kept_kvs[request.request_id] = after
        if self.eviction_log is not None:
            self.eviction_log.append((request.request_id, before, after))
        return len(freed)

    # ---------------------------------------------------------------------- swap
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        rid = request.request_id
        state = self.states.get(rid)
        if state is None or self.host_pool is None:
            return None
        if state.shared:
            return None  # shared blocks stay on the device: recompute instead
        held = state.held().astype(np.int64)
        host = self.host_pool.take(len(held))
        if host is None:
            return None
        self.pool.release(held)
        self.swapped[rid] = host.astype(np.int64)
        return list(zip(held.tolist(), host.tolist()))

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        rid = request.request_id
        state = self.states[rid]
        host = self.swapped[rid]
        dev = self.pool.take(len(host))
        if dev is None:
            return None
        cols = np.arange(state.table.shape[1])[None, :]
        state.table[cols < state.nblocks[:, None]] = dev  # held() order
        del self.swapped[rid]
        assert self.host_pool is not None
        self.host_pool.release(host)
        return list(zip(host.tolist(), dev.astype(np.int64).tolist()))

    # --------------------------------------------------------------------- checks
    def check_integrity(self) -> None:
        """Every block's ref count equals the tables holding it; free + used == total; each
        head's blocks cover its KVs."""
        live = [s for rid, s in self.states.items() if rid not in self.swapped]
        held = np.concatenate([s.held() for s in live]) if live else np.zeros(0, np.int32)
        self.pool.check(held.astype(np.int64))
        for s in self.states.values():
            assert np.all(s.nblocks == -(-s.lens // self.block_size)), "blocks != cdiv(lens)"
            room = int((s.nblocks * self.block_size - s.lens).min()) if len(s.lens) else 0
            assert s.room == room, f"room {s.room} != {room}"
        if self.host_pool is not None:
            hosts = list(self.swapped.values())
            self.host_pool.check(np.concatenate(hosts) if hosts else np.zeros(0, np.int64))
