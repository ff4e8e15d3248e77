"""Host-memory swap space for preempted requests' KV blocks."""

from __future__ import annotations

from pagedllm.core.kv_cache.block import KVCacheBlock
from pagedllm.core.kv_cache.block_pool import BlockPool


class SwapSpace:
    """Blocks of host memory. Swapping a request out moves the contents of its device blocks
    into host blocks (the model runner copies them); swapping in moves them back into freshly
    allocated device blocks. The mappings returned are (source block id, destination block id).
    """

    def __init__(self, num_host_blocks: int) -> None:
        self.pool = BlockPool(num_host_blocks, enable_caching=False) if num_host_blocks else None
        self.req_to_host_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        """Total host blocks."""
        return self.pool.num_blocks if self.pool is not None else 0

    def num_free_blocks(self) -> int:
        """Host blocks not holding a swapped request."""
        return self.pool.get_num_free_blocks() if self.pool is not None else 0

    def can_hold(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` more blocks fit in host memory."""
        return self.pool is not None and num_blocks <= self.pool.get_num_free_blocks()

    def swap_out(self, request_id: str, device_blocks: list[KVCacheBlock]) -> list[tuple[int, int]]:
        """Reserve host blocks for ``device_blocks``; returns (device id, host id) pairs."""
        assert self.pool is not None and self.can_hold(len(device_blocks))
        host = self.pool.get_new_blocks(len(device_blocks))
        self.req_to_host_blocks[request_id] = host
        return [(d.block_id, h.block_id) for d, h in zip(device_blocks, host)]

    def swap_in(self, request_id: str, device_blocks: list[KVCacheBlock]) -> list[tuple[int, int]]:
        """Release the request's host blocks into ``device_blocks``: (host id, device id)."""
        assert self.pool is not None
        host = self.req_to_host_blocks.pop(request_id)
        assert len(host) == len(device_blocks)
        pairs = [(h.block_id, d.block_id) for h, d in zip(host, device_blocks)]
        self.pool.free_blocks(host)
        return pairs

    def num_swapped_blocks(self, request_id: str) -> int:
        """Host blocks a swapped request holds."""
        return len(self.req_to_host_blocks.get(request_id, []))

    def discard(self, request_id: str) -> None:
        """Drop a swapped request's host copy (it was aborted while swapped out)."""
        host = self.req_to_host_blocks.pop(request_id, None)
        if host and self.pool is not None:
            self.pool.free_blocks(host)

    def check_integrity(self) -> None:
        """Assert host blocks in use + free == total."""
        if self.pool is None:
            return
        self.pool.check_integrity()
        used = sum(len(b) for b in self.req_to_host_blocks.values())
        assert used + self.pool.get_num_free_blocks() == self.pool.num_blocks
