"""The GPU attention backend: Triton KV write + Triton paged attention.

Per layer and step: the new K/V rows are stored at ``metadata.slot_mapping`` (slot -1 =
CUDA-graph padding, skipped) by the rotary kernel that rotates them
(:func:`pagedllm.ops.rotary.rope_and_cache`, ``fuses_rope``) or, for a caller that gives K/V,
by :func:`pagedllm.ops.kv_write.write_kv_cache`; then
:func:`pagedllm.ops.paged_attention.paged_attention` attends every query row over its request's
cached keys (the unified kernel for mixed prefill/decode batches, split-K for decode-only batches
that under-fill the GPU). All sizes come from host ints in the metadata and tensor shapes, so a
decode step captured in a CUDA graph replays correctly as sequences grow.

The metadata lives on the GPU: query_start_loc [R + 1] int32, seq_lens [R] int32,
block_tables [R, max_blocks] int32, slot_mapping [num_tokens] int64. The token count may be
padded past ``query_start_loc[-1]`` (CUDA graphs): those output rows are left uninitialised.

Importing this module imports Triton; the engine imports it only when it picks this backend.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.ops.kv_write import write_kv_cache
from pagedllm.ops.paged_attention import paged_attention, prefill_variant_query_lens


class TritonBackend(AttentionBackend):
    """GPU paged attention with Triton kernels (see module docstring).

    ``num_splits`` forces the attention path for every call (1 = unified kernel, a power of two
    > 1 = split-K on decode-only batches); None lets the dispatcher choose per step.
    """

    name = "triton"
    fuses_rope = True
    _kv_write = staticmethod(write_kv_cache)

    def __init__(self, num_splits: int | None = None) -> None:
        self.num_splits = num_splits

    prefill_variant_query_lens = staticmethod(prefill_variant_query_lens)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: written
        value: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scale: torch.Tensor | None = None,  # [2, num_kv_heads] float32: fp8 caches only
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        if key is not None:  # else the fused rope kernel wrote them
            assert value is not None
            write_kv_cache(key, value, kv_cache, metadata.slot_mapping, kv_scale)
        num_splits = self.num_splits
        if num_splits is not None and metadata.max_query_len > 1:
            num_splits = 1  # split-K takes decode-only batches
        out = paged_attention(
            query,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.max_query_len,
            metadata.max_seq_len,
            scale,
            sliding_window,
            num_splits=num_splits,
            kv_scale=kv_scale,
        )  # [num_tokens, num_heads, head_dim]
        return out.view(num_tokens, num_heads * head_dim)
