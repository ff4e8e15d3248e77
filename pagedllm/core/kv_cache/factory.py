"""Choosing the KV manager for a model's KV-cache groups."""

from __future__ import annotations

from pagedllm.core.kv_cache.interface import KVCacheManagerBase
from pagedllm.core.kv_cache.spec import KVCacheGroups


def make_kv_cache_manager(
    kv_groups: KVCacheGroups | None,
    num_blocks: int,
    block_size: int,
    enable_caching: bool,
    num_host_blocks: int = 0,
    max_num_batched_tokens: int = 2048,
) -> KVCacheManagerBase:
    """One group of full-attention layers (or no groups given): the single-table
    ``KVCacheManager``, exactly the layout of a model without windows. Otherwise (a
    sliding-window group, or several groups): ``HybridKVCacheManager``. KV-Compress (a
    ``HeadPagedSpec``): ``HeadPagedKVCacheManager``, per-head tables, its prefix cache
    protecting what requests share."""
    if kv_groups is not None and kv_groups.head_paged is not None:
        from pagedllm.core.kv_cache.head_paged import HeadPagedKVCacheManager

        return HeadPagedKVCacheManager(
            kv_groups.head_paged, num_blocks, num_host_blocks, enable_caching
        )
    if kv_groups is None or (kv_groups.num_groups == 1 and not kv_groups.is_hybrid):
        from pagedllm.core.kv_cache.manager import KVCacheManager

        return KVCacheManager(num_blocks, block_size, enable_caching, num_host_blocks)
    if kv_groups.block_size != block_size:
        raise ValueError(
            f"KV-cache groups use block_size {kv_groups.block_size}, the cache {block_size}."
        )
    from pagedllm.core.kv_cache.hybrid import HybridKVCacheManager

    return HybridKVCacheManager(
        kv_groups, num_blocks, enable_caching, num_host_blocks, max_num_batched_tokens
    )
