"""KV cache blocks and the O(1) doubly linked queue of free blocks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple


class BlockHash(NamedTuple):
    """Identity of a full block's contents: a digest chained from the parent block's digest,
    plus the block's own token ids. Dict lookups compare the token ids too, so a digest
    collision can never hand a request someone else's KV."""

    digest: bytes
    token_ids: tuple[int, ...]


class KVCacheBlock:
    """One physical block of the KV cache (``block_size`` tokens, every layer and KV head).

    ``ref_cnt`` counts the sequences that use the block; at 0 it sits in the free queue, still
    holding its cached contents (``block_hash``) until a new allocation evicts it.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={cached})"


class FreeBlockQueue:
    """Free blocks, in eviction order (front = evicted first), as a list threaded through the
    blocks themselves: popleft, append, appendleft and remove-from-the-middle are all O(1) and
    allocate nothing.

    Example: queue [b3, b1, b7]; remove(b1) when a prefix hit revives b1 -> [b3, b7];
    popleft() -> b3.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels: never handed out
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The first ``n`` blocks, unlinked in one pass (the caller checked there are n)."""
        out = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None and block is not self._tail, "fewer than n free blocks"
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        nxt = prev.next_free
        assert nxt is not None
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks
