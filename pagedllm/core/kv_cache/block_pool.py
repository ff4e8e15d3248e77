"""The pool of physical KV cache blocks: allocation, ref counts and the prefix cache."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pagedllm.core.kv_cache.block import BlockHash, FreeBlockQueue, KVCacheBlock


class BlockPool:
    """Owns every block. Free blocks wait in an LRU queue; a block whose contents are cached
    (it has a ``block_hash``) stays findable by its hash until it is evicted by reuse.

    Eviction order: blocks that were never cached are freed to the front of the queue (reused
    first); cached blocks are freed to the back, tail blocks of a request before its head blocks,
    so the longest-lived entries are the shared prefixes.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, reserve_null: bool = False) -> None:
        if num_blocks < 1 + int(reserve_null):
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        # Keys: a BlockHash, or (group, BlockHash) for the groups of a hybrid manager.
        self.cached_block_hash_to_block: dict[BlockHash | tuple, KVCacheBlock] = {}
        self.num_evictions = 0
        # The null block (id 0) fills the table entries of a sliding-window group that fell
        # out of the window: never handed out, never freed, never cached, never read.
        self.null_block: KVCacheBlock | None = None
        if reserve_null:
            self.null_block = self.free_block_queue.popleft()
            self.null_block.ref_cnt = 1

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, whether or not their contents are cached)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks in use by some request, in [0, 1]."""
        usable = self.num_blocks - int(self.null_block is not None)
        return 1.0 - self.get_num_free_blocks() / usable

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, evicting cached
        contents, each with ref_cnt 1."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} free"
            )
        out = self.free_block_queue.popleft_n(num_blocks)
        for block in out:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit or a fork); a block that was free
        leaves the free queue."""
        null = self.null_block
        for block in blocks:
            if block is null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue in the given
        order (the caller passes a request's blocks tail first)."""
        null = self.null_block
        for block in ordered_blocks:
            if block is null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding these contents, if still cached."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a just-filled block under its hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return
        block.block_hash = block_hash
        self.cached_block_hash_to_block.setdefault(block_hash, block)

    def uncache(self, block: KVCacheBlock) -> Any:
        """Forget a block's cache entry (its contents are not what its hash says); its key,
        or None when it had none. Whoever holds it keeps it."""
        key, block.block_hash = block.block_hash, None
        if key is not None and self.cached_block_hash_to_block.get(key) is block:
            del self.cached_block_hash_to_block[key]
        return key

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - int(self.null_block is not None):
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def check_integrity(self) -> None:
        """Assert the pool's invariants: free queue = blocks with ref_cnt 0; the hash map only
        points at blocks that carry that hash."""
        in_queue = set()
        for block in self.free_block_queue:
            assert block.ref_cnt == 0, f"{block} in free queue with references"
            assert block.block_id not in in_queue, f"{block} twice in free queue"
            in_queue.add(block.block_id)
        assert len(in_queue) == self.free_block_queue.num_free_blocks
        if self.null_block is not None:
            assert self.null_block.ref_cnt == 1 and self.null_block.block_hash is None
        for block in self.blocks:
            assert block.ref_cnt >= 0
            if block.ref_cnt == 0:
                assert block.block_id in in_queue, f"{block} unreferenced but not free"
        for h, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == h, f"{block} indexed under a hash it does not carry"
