"""The KV manager of one group of layers: per-request block tables on top of the block pool.

Alone, it is the whole manager of a model whose layers all use full attention (one block
table per request). Inside ``HybridKVCacheManager`` one instance serves each KV-cache group,
all sharing one pool (see ``hybrid.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pagedllm.core.kv_cache.block import BlockHash, KVCacheBlock
from pagedllm.core.kv_cache.block_pool import BlockPool
from pagedllm.core.kv_cache.hashing import block_hash_extra, hash_request_blocks
from pagedllm.core.kv_cache.interface import KVCacheManagerBase
from pagedllm.core.kv_cache.spec import cdiv
from pagedllm.core.kv_cache.swap import SwapSpace
from pagedllm.core.request import Request

__all__ = ["KVCacheManager", "cdiv"]


class KVCacheManager(KVCacheManagerBase):
    """Maps each request to the list of blocks that hold its KV (its block table).

    Token ``i`` of a request lives in block ``blocks[i // block_size]`` at offset
    ``i % block_size``. With prefix caching on, full blocks are registered by chained hash so a
    later request with the same prefix reuses them (``get_computed_blocks``).

    As one group of a hybrid manager it gets the shared ``block_pool``, its ``group`` index
    (tagging its prefix-cache keys and copy-on-write entries) and the shared per-request
    ``hashes`` (the chained block hashes are the same in every group).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        num_host_blocks: int = 0,
        *,
        block_pool: BlockPool | None = None,
        group: int = 0,
        hashes: dict[str, list[BlockHash]] | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = block_pool or BlockPool(num_blocks, enable_caching)
        self.swap_space = SwapSpace(num_host_blocks)
        self.group = group
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = hashes if hashes is not None else {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        # Copy-on-write copies (src block id, dst block id) for the runner, drained each step.
        self.pending_copies: list[tuple[int, int]] = []
        # Per request: (table index, new block id) replaced by copy-on-write since last taken.
        self.replaced: dict[str, list[tuple[int, int, int]]] = {}
        self.num_cow_copies = 0

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        return hash_request_blocks(
            request.all_token_ids,
            self.block_size,
            hashes,
            block_hash_extra(request),
        )

    def _key(self, block_hash: BlockHash) -> BlockHash | tuple:
        """The block's prefix-cache key: its hash, tagged with the group in a hybrid manager."""
        return block_hash if self.group == 0 else (self.group, block_hash)

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """Tokens a prefix hit would give the request now (no side effects, no stats)."""
        if not self.uses_prefix_cache(request):
            return 0
        n = 0
        for block_hash in self._block_hashes(request)[
            : (request.num_tokens - 1) // self.block_size
        ]:
            if self.block_pool.get_cached_block(self._key(block_hash)) is None:
                break
            n += self.block_size
        return n

    def token_capacity(self) -> int:
        """Most tokens one request can hold: the whole pool."""
        return self.block_pool.num_blocks * self.block_size

    def can_allocate(self, request: Request, budget: int) -> bool:
        """Whether the free blocks hold the request's next chunk of up to ``budget`` tokens:
        after its prefix hit, or (swapped out) all its blocks plus the chunk."""
        if request.swapped:
            start = hit = request.num_computed_tokens
            need = cdiv(start + min(request.num_tokens - start, budget), self.block_size)
        else:
            start = hit = self.num_cached_prefix_tokens(request)
            chunk = min(request.num_tokens - start, budget)
            need = cdiv(start + chunk, self.block_size) - hit // self.block_size
        return need <= self.num_free_blocks()

    def new_block_ids(self, new_blocks: Sequence[KVCacheBlock]) -> tuple[list[int], ...]:
        """The runner's view of ``allocate_slots``' result: ids per group (one group)."""
        return ([b.block_id for b in new_blocks],) if new_blocks else ()

    def get_block_table(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group (one group here)."""
        return (self.get_block_ids(request_id),)

    def request_tables(self) -> Iterator[tuple[str, list[int]]]:
        for rid, blocks in self.req_to_blocks.items():
            yield rid, [b.block_id for b in blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks that starts the request's tokens, and how many
        tokens they cover. At most ``num_tokens - 1`` tokens are reused, so the last token is
        always recomputed to produce logits.

        Example: block_size 4, 10 tokens, blocks 0 and 1 cached -> 2 blocks, 8 tokens;
        with 8 tokens and both cached -> 1 block, 4 tokens (8 would leave nothing to compute).
        """
        if not self.uses_prefix_cache(request):
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(self._key(block_hash))
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (after its computed ones
        and any ``new_computed_blocks`` from a prefix hit), plus lookahead slots for speculative
        tokens. Returns the newly allocated blocks, or None if the pool is too short (then
        nothing changes).

        Example: block_size 16, 20 computed tokens in 2 blocks, 13 new tokens -> 33 tokens need
        3 blocks -> 1 new block.
        """
        if not new_computed_blocks and not num_lookahead_tokens:
            fast = self._fits_in_own_blocks(request, num_new_tokens)
            if fast is not None:
                return fast
        need = self.num_blocks_to_allocate(
            request, num_new_tokens, new_computed_blocks, num_lookahead_tokens
        )
        if need > self.block_pool.get_num_free_blocks():
            return None
        return self.allocate(request, num_new_tokens, new_computed_blocks, num_lookahead_tokens)

    def _plan(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock],
        num_lookahead_tokens: int,
    ) -> tuple[list[KVCacheBlock], int, int, int | None]:
        """(the table, tokens computed after the hit, new blocks needed, index of a shared
        block the first new token lands in (copy-on-write) or None)."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - len(new_computed_blocks))
        cow = self._shared_write_block(blocks, num_computed, num_new_tokens)
        return blocks, num_computed, num_new_blocks, cow

    def num_blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> int:
        """Free blocks ``allocate`` would take: new blocks, a copy-on-write copy, and cached
        blocks of a prefix hit revived from the free queue."""
        computed = new_computed_blocks or []
        _, _, num_new_blocks, cow = self._plan(
            request, num_new_tokens, computed, num_lookahead_tokens
        )
        num_revived = sum(1 for b in computed if b.ref_cnt == 0)
        return num_new_blocks + int(cow is not None) + num_revived

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock]:
        """``allocate_slots`` once the room is known to be there (the caller checked
        ``num_blocks_to_allocate``)."""
        computed = new_computed_blocks or []
        blocks, num_computed, num_new_blocks, cow = self._plan(
            request, num_new_tokens, computed, num_lookahead_tokens
        )
        blocks = self.req_to_blocks.setdefault(request.request_id, blocks)
        # Copy-on-write: the block that receives the first new token is shared with a forked
        # sibling (ref_cnt > 1): this request writes into a private copy.
        if cow is not None:
            self._copy_on_write(request, blocks, cow)
        if computed:
            self.block_pool.touch(computed)
            blocks.extend(computed)
            self.num_cached_blocks[request.request_id] = len(blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching:
            # Register blocks that become full with this step's tokens (known tokens only:
            # lookahead slots hold speculative tokens that may be rejected).
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            self._cache_full_blocks(request, blocks, num_full)
        return new_blocks

    def _fits_in_own_blocks(self, request: Request, num_new_tokens: int) -> list | None:
        """The common decode case, cheaply: the new tokens fit in blocks the request already
        holds alone, so nothing is allocated or copied (returns []); None otherwise."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return None
        bs = self.block_size
        start = request.num_computed_tokens
        end = start + num_new_tokens
        first = start // bs
        if end > len(blocks) * bs or (first < len(blocks) and blocks[first].ref_cnt > 1):
            return None
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, min(end, request.num_tokens) // bs)
        return []

    def _shared_write_block(
        self, blocks: list[KVCacheBlock], num_computed: int, num_new_tokens: int
    ) -> int | None:
        """Index of the existing block the next token lands in, if other tables share it."""
        i = num_computed // self.block_size
        if num_new_tokens > 0 and i < len(blocks) and blocks[i].ref_cnt > 1:
            return i
        return None

    def _copy_on_write(self, request: Request, blocks: list[KVCacheBlock], i: int) -> None:
        """Give ``request`` a private copy of its shared block ``i``; the runner copies the
        contents before the step's forward pass."""
        old = blocks[i]
        (new,) = self.block_pool.get_new_blocks(1)
        self.pending_copies.append((old.block_id, new.block_id))
        self.block_pool.free_blocks([old])  # one reference less; siblings keep theirs
        blocks[i] = new
        self.replaced.setdefault(request.request_id, []).append((self.group, i, new.block_id))
        self.num_cow_copies += 1

    def fork(self, parent: Request, child: Request) -> None:
        """Share every block of ``parent`` with ``child`` (ref_cnt + 1 each): the prompt is
        stored once; a partly filled last block is copied when one of them writes to it.

        Example: block_size 4, a 6-token prompt in blocks [3, 8]: after fork(parent, c1)
        both tables are [3, 8] with ref_cnt 2; c1's next token (position 6) lands in block 8,
        so c1 gets a copy [3, 9] and block 8 drops back to ref_cnt 1.
        """
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)
        prompt_blocks = parent.num_prompt_tokens // self.block_size
        cached = min(self.num_cached_blocks.get(parent.request_id, 0), prompt_blocks)
        self.num_cached_blocks[child.request_id] = cached
        hashes = self.req_to_block_hashes.get(parent.request_id, [])
        self.req_to_block_hashes[child.request_id] = list(hashes[:prompt_blocks])

    def take_replaced(self, request_id: str) -> list[tuple[int, int, int]]:
        """(group, table index, new block id) entries copy-on-write changed for a request."""
        return self.replaced.pop(request_id, [])

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Drain the copy-on-write (src, dst) copies for the runner."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_full: int
    ) -> None:
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], self._key(hashes[i]))
        self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its prefix outlives its suffix in the
        prefix cache."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(request.request_id, None)
        if request.is_finished:
            self.req_to_block_hashes.pop(request.request_id, None)
            self.swap_space.discard(request.request_id)

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host memory: returns (device, host) block pairs for the
        runner to copy, and frees the device blocks (they stay prefix-cached). None (and no
        change) when the swap space is too small."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        if not blocks or not self.swap_space.can_hold(len(blocks)):
            return None
        pairs = self.swap_space.swap_out(request.request_id, blocks)
        self.free(request)
        return pairs

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back into new device blocks: (host, device) pairs, or None
        when the device pool is too short."""
        n = self.swap_space.num_swapped_blocks(request.request_id)
        if n > self.block_pool.get_num_free_blocks():
            return None
        blocks = self.block_pool.get_new_blocks(n)
        self.req_to_blocks[request.request_id] = blocks
        self.num_cached_blocks[request.request_id] = 0  # re-registered as they are full
        return self.swap_space.swap_in(request.request_id, blocks)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Physical block ids of a request, in token order."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def check_integrity(self) -> None:
        """Assert: every block's ref_cnt equals the number of block tables holding it, and
        free + in use == total."""
        self._check_tables(self.req_to_blocks.values())
