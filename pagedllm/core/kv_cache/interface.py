"""The KV-manager protocol: what the scheduler asks of a KV cache manager.

The scheduler does no block arithmetic: it asks the manager whether a request's next chunk
fits, for the request's prefix hit, for room for new tokens, and hands the runner the block ids
the manager returns. A new manager (per-head KV-Compress tables, fp8 pages, ...) implements
every abstract method below and is chosen by ``make_kv_cache_manager`` (``factory.py``) from the
model's ``KVCacheGroups`` (``spec.py``).

The contract, request by request:

- ``get_computed_blocks(r)`` -> (blocks, num_tokens): the longest cached prefix (a multiple of
  the block size, at most ``r.num_tokens - 1`` tokens), with no side effects; ``blocks`` is
  opaque to the scheduler and goes back to ``allocate_slots``.
- ``allocate_slots(r, num_new, blocks, lookahead)``: room for ``num_new`` more tokens after
  ``r.num_computed_tokens`` (and after the hit ``blocks``), plus ``lookahead`` speculative
  slots; returns the new blocks (opaque; ``new_block_ids`` turns them into ids per group for
  the runner), or None when the pool is short, and then nothing the runner could see changed.
  Blocks that become full with known tokens are registered in the prefix cache.
- ``free(r)``: every block back to the pool (cached ones stay findable until evicted);
  ``fork(parent, child)``: the child shares every block (copy-on-write on its next write; the
  copies come out of ``take_pending_copies``, the changed table entries out of
  ``take_replaced``).
- ``swap_out(r)`` / ``swap_in(r)``: (src, dst) block pairs to copy, or None when there is no
  room.
- ``check_integrity()``: every block's ref count equals the tables holding it; free + used ==
  total.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from pagedllm.core.kv_cache.block import KVCacheBlock
from pagedllm.core.kv_cache.block_map import BlockMap, build_block_map
from pagedllm.core.kv_cache.block_pool import BlockPool
from pagedllm.core.kv_cache.swap import SwapSpace
from pagedllm.core.request import Request


class KVCacheManagerBase(ABC):
    """The KV manager protocol (see the module docstring). Every manager has the attributes
    below; the capacity and prefix-cache counters are read off its ``block_pool``."""

    block_size: int
    enable_caching: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_cow_copies: int
    block_pool: BlockPool
    swap_space: SwapSpace

    # ------------------------------------------------------------------ capacity
    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use by requests, in [0, 1]."""
        return self.block_pool.get_usage()

    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (cached-but-free ones included)."""
        return self.block_pool.get_num_free_blocks()

    @abstractmethod
    def token_capacity(self) -> int:
        """The most tokens one request can ever hold, alone in the cache."""

    @abstractmethod
    def can_allocate(self, request: Request, budget: int) -> bool:
        """Whether the request's next chunk (up to ``budget`` tokens after its prefix hit, or
        after its swapped-out tokens) fits in the free blocks now."""

    # -------------------------------------------------------------- prefix cache
    def uses_prefix_cache(self, request: Request) -> bool:
        """Prompt logprobs need the logits of every prompt position: no prefix hit then."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    @abstractmethod
    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Tokens ``get_computed_blocks`` would give now (no side effects, no stats)."""

    @abstractmethod
    def get_computed_blocks(self, request: Request) -> tuple[Any, int]:
        """The cached prefix: (blocks for ``allocate_slots``, number of tokens)."""

    def record_prefix_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one admitted request's lookup in the prefix-cache metrics (tokens)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (and nothing done) while blocks are in use."""
        return self.block_pool.reset_prefix_cache()

    # ---------------------------------------------------------------- allocation
    @abstractmethod
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
    ) -> Sequence | None:
        """Room for the request's next tokens; the new blocks, or None (see the module
        docstring)."""

    @abstractmethod
    def new_block_ids(self, new_blocks: Sequence) -> tuple[list[int], ...]:
        """Block ids per KV-cache group of an ``allocate_slots`` result; () when none."""

    @abstractmethod
    def get_block_table(self, request_id: str) -> tuple[list[int], ...]:
        """The request's whole block table, one list of ids per KV-cache group."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first: its prefix outlives its suffix)."""

    @abstractmethod
    def fork(self, parent: Request, child: Request) -> None:
        """Share every block of ``parent`` with ``child`` (copy-on-write)."""

    @abstractmethod
    def take_replaced(self, request_id: str) -> list[tuple[int, int, int]]:
        """(group, table index, new block id) entries copy-on-write changed since last taken."""

    @abstractmethod
    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Drain the copy-on-write (src, dst) block copies for the runner."""

    # ---------------------------------------------------------------------- swap
    @abstractmethod
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """(device, host) pairs to copy out, the device blocks freed; None if no room."""

    @abstractmethod
    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """(host, device) pairs to copy back into new blocks; None if the pool is short."""

    def uncache_blocks(self, block_ids: Iterable[int]) -> list[Any]:
        """Forget the prefix-cache entries of these device blocks (a KV load into them
        failed, so their contents are not what their keys say); their holders keep them.
        Returns the keys dropped (a host tier forgets its copies of them)."""
        pool = self.block_pool
        keys = [pool.uncache(pool.blocks[i]) for i in block_ids]
        return [k for k in keys if k is not None]

    # ----------------------------------------------------------------------- map
    def block_map(self) -> BlockMap:
        """Every device block's state and a request holding it (``block_map.py``), for the
        dashboard. It walks every table: call it between steps, a few times a second at most."""
        pool = self.block_pool
        cached = [b.block_id for b in pool.cached_block_hash_to_block.values()]
        null = pool.null_block
        reserved = [null.block_id] if null is not None else []
        return build_block_map(pool.num_blocks, self.request_tables(), cached, reserved)

    def request_tables(self) -> Iterable[tuple[str, list[int]]]:
        """(request id, device block ids) of every table, one per request and KV group."""
        raise NotImplementedError(f"{type(self).__name__} has no block map")

    # --------------------------------------------------------------------- checks
    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the ref counts and the free/used accounting (see the module docstring)."""

    def _check_tables(self, tables: Iterable[list[KVCacheBlock]]) -> None:
        """Assert: every block's ref_cnt equals the number of ``tables`` holding it (the null
        block aside), free + in use == total, and the pool's and swap space's invariants."""
        self.block_pool.check_integrity()
        null = self.block_pool.null_block
        refs: dict[int, int] = {}
        for table in tables:
            for b in table:
                if b is not null:
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.block_pool.blocks:
            if block is null:
                continue
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"{block}: ref_cnt != {refs.get(block.block_id, 0)} table references"
            )
        num_used = sum(1 for b in self.block_pool.blocks if b.ref_cnt > 0)
        assert num_used + self.num_free_blocks() == self.num_blocks
        self.swap_space.check_integrity()

    def is_idle_clean(self) -> bool:
        """Whether every usable block is free (what an idle engine must see)."""
        return self.num_free_blocks() == self.num_blocks - int(
            self.block_pool.null_block is not None
        )


@runtime_checkable
class PerHeadKVManager(Protocol):
    """What a per-head KV manager (KV-Compress: a block table per (layer, KV head),
    ``core/kv_cache/head_paged.py``) offers beyond ``KVCacheManagerBase``: the operations the
    KV-Compress planner (``core/sched/kvc.py``) asks of it, and nothing the scheduler asks.

    - ``compressible``: [LH] bool, the (layer, KV head) pairs a budget counts;
    - ``blocks_for_tokens(n)``: blocks a request holding none takes for its first n tokens;
    - ``blocks_short(r, n)``: blocks missing from the pools (one per tensor-parallel rank) for
      n more tokens of r (0: fits);
    - ``held_kvs(rid)``: KVs r holds in compressible heads after its shared cached prefix;
    - ``head_extent(rid)``: (its longest head's KVs, ``held_kvs``);
    - ``prefix_tokens(rid)``: tokens of its cached prefix that another request shares now;
    - ``settle_prefix(r)``: before an eviction is planned, protect that prefix; its tokens;
    - ``detach_own(r, keep_cached)``: its own cached blocks leave the cache's care before an
      eviction rewrites them: (new table entries, the ids they copy) or None;
    - ``apply_compaction(r, lens, computed)``: the runner's new per-head lengths; blocks freed;
    - ``drop_last(r, n)``: r's last n computed tokens were taken back (rejected draft tokens):
      every head drops its last n KVs; blocks freed.
    """

    block_size: int
    compressible: Any
    num_compressions: int  # evictions applied so far
    num_evicted_kvs: int  # KVs they removed

    def num_free_blocks(self) -> int: ...
    def blocks_for_tokens(self, num_tokens: int) -> int: ...
    def blocks_short(self, request: Request, num_new: int) -> int: ...
    def held_kvs(self, request_id: str) -> int: ...
    def head_extent(self, request_id: str) -> tuple[int, int]: ...
    def prefix_tokens(self, request_id: str) -> int: ...
    def settle_prefix(self, request: Request) -> int: ...
    def detach_own(self, request: Request, keep_cached: bool = False) -> Any: ...
    def apply_compaction(self, request: Request, lens: Any, computed: int | None = None) -> int: ...
    def drop_last(self, request: Request, num_tokens: int) -> int: ...


@runtime_checkable
class PerHeadRows(Protocol):
    """What a per-head KV manager offers the roles that move whole blocks of a request's
    prompt (the host tier, ``core/sched/offload.py``; KV transfers,
    ``core/kv_transfer/scheduler.py``), beyond ``KVCacheManagerBase``: a row is block i of
    every (layer, KV head), as long as the request was never evicted from.

    - ``block_columns(rid, first, n)``: [n, LH] the block ids of blocks first..first+n-1;
    - ``count_loaded(rid, n)``: the first n tokens of the latest allocation were loaded, not
      computed (the runner's table counts them);
    - ``fits_first(r, n)``: whether a request not yet admitted finds blocks for n tokens
      after its prefix hit;
    - ``block_hashes(r)`` / ``cached_ids(key)``: the prefix cache's keys of r's full blocks,
      and the [LH] blocks of the device cache's entry for a key (None: not cached).
    """

    block_size: int

    def block_columns(self, request_id: str, first: int, n: int) -> Any: ...
    def count_loaded(self, request_id: str, num_tokens: int) -> None: ...
    def fits_first(self, request: Request, num_tokens: int) -> bool: ...
    def block_hashes(self, request: Request) -> list: ...
    def cached_ids(self, key: Any) -> Any: ...
