"""Triton kernel that writes the new K/V rows of a step into the paged KV cache.

Cache layout (one layer): ``kv_cache`` is [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = K, 1 = V). Token t goes to ``slot = slot_mapping[t] = block_id * block_size + offset``;
slot -1 means "skip" (the padding rows of a CUDA graph), so those rows are never written.

Example: block_size 16, slot 37 -> block 2, offset 5 -> kv_cache[0, 2, 5, h, :] = key[t, h, :].

The kernel runs one program per (token, KV head) and copies ``head_dim`` contiguous elements of K
and of V; no host sync, no data-dependent Python branch, so it is CUDA-graph capturable.
``write_kv_cache_ref`` (the PyTorch version in ``pagedllm.kv_layout``) is what tests compare with.

This module imports Triton at import time: import it only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kv_layout import is_fp8
from pagedllm.kv_layout import write_kv_ref as write_kv_cache_ref

__all__ = ["write_kv_cache", "write_kv_cache_ref"]


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim] (any strides, last one 1)
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # kv_cache[0]: [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # kv_cache[1]
    slot_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache stride between blocks
    stride_cs,  # cache stride between slots of a block
    stride_ch,  # cache stride between KV heads
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,
    scale_ptr=None,  # QUANT: [2, num_kv_heads] float32, K's scales then V's
    num_kv_heads=0,
    QUANT: tl.constexpr = False,  # fp8 cache: store clamp(x / scale, -448, 448)
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    # Example: BLOCK_SIZE 16, slot 37 -> block 2, offset 5.
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    d = tl.arange(0, HEAD_PAD)
    mask = (d < HEAD_DIM) & (slot >= 0)  # slot -1: nothing loaded, nothing stored
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + h * stride_vh + d, mask=mask)
    dst = block * stride_cb + offset * stride_cs + h * stride_ch + d
    if QUANT:
        k = tl.clamp(k.to(tl.float32) / tl.load(scale_ptr + h), -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / tl.load(scale_ptr + num_kv_heads + h), -448.0, 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [n] int64, n <= num_tokens; -1 = skip
    kv_scale: torch.Tensor | None = None,  # [2, num_kv_heads] float32: an fp8 cache's scales
) -> None:
    """kv_cache[0/1] at slot_mapping[t] = key/value[t] for t < len(slot_mapping); -1 skipped.

    Same semantics as :func:`write_kv_cache_ref`. ``key``/``value`` may be strided views (e.g.
    slices of a fused QKV projection) as long as their last dimension is contiguous; the values
    are cast to the cache dtype (an fp8 cache: fp8(clamp(x / scale, -448, 448))).
    """
    n = slot_mapping.shape[0]
    if n == 0:
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    assert kv_cache.shape[0] == 2 and kv_cache.shape[3:] == (num_kv_heads, head_dim)
    assert key.shape[0] >= n and value.shape[0] >= n
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    quant = is_fp8(kv_cache.dtype)
    if quant and kv_scale is None:
        raise ValueError("write_kv_cache: an fp8 cache needs kv_scale [2, num_kv_heads]")
    _write_kv_kernel[(n, num_kv_heads)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2],
        scale_ptr=kv_scale,
        num_kv_heads=num_kv_heads,
        QUANT=quant,
        num_warps=1 if head_dim <= 128 else 2,
    )
