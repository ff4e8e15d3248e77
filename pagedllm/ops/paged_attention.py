"""Triton paged attention over a flattened mixed batch (prefill chunks + decodes), with a
split-K (flash-decoding) path for decode-only batches with long contexts at small batch.

Inputs (all on one device):

- ``query`` [num_tokens, num_heads, head_dim]; request r owns rows
  ``query_start_loc[r]:query_start_loc[r+1]``; row i of r sits at position
  ``seq_lens[r] - q_len[r] + i``.
- ``kv_cache`` [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V). The step's new
  K/V are already written (see :mod:`pagedllm.ops.kv_write`), so the kernels read only the cache:
  position p of request r lives at ``kv_cache[:, block_tables[r, p // block_size],
  p % block_size]``.
- Causal: key j is visible to the query at position p iff ``j <= p`` (and ``j > p - window`` on a
  sliding-window layer). GQA: query head h reads KV head ``h // (num_heads // num_kv_heads)``.

Kernels:

- ``_unified_kernel``: one program per (query tile of one request, KV head). A tile holds
  ``BLOCK_Q`` consecutive query tokens of one request times the ``G = num_heads / num_kv_heads``
  query heads that share the KV head, flattened into ``BLOCK_M = BLOCK_Q * G`` (padded) rows, so
  every K/V tile loaded from the cache serves the whole GQA group. Online softmax over tiles of
  ``TILE_N`` keys (a tile may span several cache blocks: each key looks up its own block id);
  tiles that every row sees whole skip the causal/window mask and the bounds checks. A
  decode-only batch (``max_query_len <= 1``) runs one program per (request, KV head) and skips
  the search for the request of a tile.
- ``_split_kernel`` + ``_reduce_kernel``: decode-only batches (every q_len <= 1). One program per
  (request, KV head, split); split s attends over the s-th of ``NUM_SPLITS`` equal slices of the
  request's key tiles and writes its un-normalised accumulator, running max and running sum; the
  reduce kernel rescales and combines them. The slice length is computed in the kernel from
  ``seq_lens``, so ``NUM_SPLITS`` is the only shape and a captured CUDA graph stays right as
  sequences grow.

Everything is sized from host ints (tensor shapes, ``max_query_len``, ``max_seq_len``): no host
sync and no Python branch on device values, so decode batches are CUDA-graph capturable. Rows of
``query`` past ``query_start_loc[-1]`` (CUDA-graph padding) are never written.

The GPU kernels benchmark (``benchmarks/README.md``) reports decode against the device's copy
bandwidth and prefill in TFLOP/s.

This module imports Triton at import time: import it only where Triton is installed. Under
``TRITON_INTERPRET=1`` the kernels also run on CPU tensors (slowly), for tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kv_layout import dequantize, is_fp8

__all__ = [
    "TileConfig",
    "choose_num_splits",
    "default_tile_config",
    "paged_attention",
    "paged_attention_ref",
]

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _find_request(qsl_ptr, tile_idx, num_reqs, BLOCK_Q: tl.constexpr):
    """The request r whose query tiles contain global tile ``tile_idx`` (binary search).

    Request r's tiles are numbered from ``qsl[r] // BLOCK_Q + r``: that leaves at least
    ceil(q_len / BLOCK_Q) numbers per request, and the total is at most
    ``num_tokens // BLOCK_Q + num_reqs`` (the grid size), known on the host.
    Example: BLOCK_Q 4, qsl [0, 5, 6, 16] -> first tiles [0, 2, 4], grid 16 // 4 + 3 = 7:
    tiles 0-1 -> request 0 (tokens 0-3, 4), tiles 2-3 -> request 1 (token 5; tile 3 empty),
    tiles 4-6 -> request 2 (tokens 6-9, 10-13, 14-15).
    """
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tiles(
    acc,  # [BLOCK_M, HEAD_PAD] fp32, un-normalised output
    l_i,  # [BLOCK_M] fp32 running sum of exp2
    m_i,  # [BLOCK_M] fp32 running max (log2 units)
    q,  # [BLOCK_M, HEAD_PAD] query tile (query dtype)
    q_pos,  # [BLOCK_M] int32 position of each query row
    win_lo,  # [BLOCK_M] int32: keys must be > win_lo (-1 without a window)
    k_cache_ptr,
    v_cache_ptr,
    bt_row_ptr,  # block table row of the request
    kv_head_off,  # kv_head * stride_ch
    tile_lo,
    tile_hi,
    key_end,  # keys >= key_end are never read
    qk_scale,  # softmax scale * log2(e)
    stride_cb,
    stride_cs,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,  # dots in fp32 (the CPU interpreter mis-computes bf16 dots)
    PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (unused for 16-bit)
    MASKED: tl.constexpr,  # False: every key of every tile is visible to every valid row
):
    """Online softmax over key tiles ``[tile_lo, tile_hi)``; returns the updated (acc, l, m)."""
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_DIM
    for tile in range(tile_lo, tile_hi):
        j = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] key positions
        j_mask = j < key_end
        # Example: BLOCK_SIZE 16, j = 37 -> block table column 2, offset 5 in that block.
        if MASKED:
            blk = tl.load(bt_row_ptr + j // BLOCK_SIZE, mask=j_mask, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row_ptr + j // BLOCK_SIZE).to(tl.int64)
        off = blk * stride_cb + (j % BLOCK_SIZE) * stride_cs + kv_head_off  # [TILE_N]
        kv_ptrs = off[:, None] + d[None, :]  # [TILE_N, HEAD_PAD]
        if MASKED:
            kv_mask = j_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        elif HEAD_PAD == HEAD_DIM:
            k = tl.load(k_cache_ptr + kv_ptrs)
            v = tl.load(v_cache_ptr + kv_ptrs)
        else:
            k = tl.load(k_cache_ptr + kv_ptrs, mask=d_mask[None, :], other=0.0)
            v = tl.load(v_cache_ptr + kv_ptrs, mask=d_mask[None, :], other=0.0)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        s = s * qk_scale  # [BLOCK_M, TILE_N], log2 units
        if MASKED:
            visible = (
                (j[None, :] <= q_pos[:, None]) & (j[None, :] > win_lo[:, None]) & j_mask[None, :]
            )
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps max -inf: use 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        else:  # (an fp8 cache's V in the query's dtype: the dot stays 16-bit)
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fp16_query(q, UPCAST: tl.constexpr):
    """An fp8 cache's query tile in float16 (clamped to its range): e4m3 K and V convert to
    float16 in one instruction per pair (to bfloat16 it takes several), and the dots and the
    probabilities then run in float16 (3 more mantissa bits than bfloat16). The CPU
    interpreter's dots stay in float32 (UPCAST)."""
    if UPCAST:
        return q
    return tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def _query_tile(
    q_ptr, q_start, q_len, ctx, local, kvh, window, stride_qt, stride_qh,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
):  # fmt: skip
    """A prefill tile's rows, its queries and the key tiles it reads (the unified paged
    kernel's and KV-Compress's per-head prefill kernel's): tile ``local`` of a chunk of
    ``q_len`` queries whose first sits at row ``q_start`` after ``ctx`` cached keys.

    Row m of the tile = query token local * BLOCK_Q + m // G, query head kvh * G + m % G.
    Example: G 4, BLOCK_M 16 (BLOCK_Q 4), kvh 1, m 9 -> token offset 2, head 5. Keys the tile
    can see: [first query pos - window + 1, last query pos]."""
    m = tl.arange(0, BLOCK_M)
    qi = local * BLOCK_Q + m // G  # [BLOCK_M] query index within the chunk
    head = kvh * G + m % G
    row_mask = (m < BLOCK_Q * G) & (qi < q_len)
    q_pos = ctx + qi  # each row's own position
    win_lo = tl.where(window > 0, q_pos - window, -1)
    d = tl.arange(0, HEAD_PAD)
    tok = (q_start + qi).to(tl.int64)  # [BLOCK_M] query row of each
    io_mask = row_mask[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=io_mask,
        other=0.0,
    )
    first_pos = ctx + local * BLOCK_Q
    key_end = ctx + tl.minimum((local + 1) * BLOCK_Q, q_len)
    key_start = tl.maximum(tl.where(window > 0, first_pos - window + 1, 0), 0)
    tile_lo = key_start // TILE_N
    tile_hi = (key_end + TILE_N - 1) // TILE_N
    return q, q_pos, win_lo, tok, head, d, io_mask, first_pos, key_end, tile_lo, tile_hi


@triton.jit
def _store_tile(out_ptr, acc, l_i, tok, head, d, io_mask, stride_ot, stride_oh):
    """A prefill tile's rows out: acc / l (rows that saw no key: acc itself, 0)."""
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


@triton.jit
def _attend_range(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    win_lo,
    k_cache_ptr,
    v_cache_ptr,
    bt_row_ptr,
    kv_head_off,
    tile_lo,
    tile_hi,
    first_pos,  # smallest position of the valid query rows
    key_end,  # largest position of the valid query rows + 1
    window,
    qk_scale,
    stride_cb,
    stride_cs,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Tiles ``[tile_lo, tile_hi)`` in three runs: masked, mask-free, masked.

    A tile is mask-free when all its keys are visible to every valid query row: it ends at or
    before ``first_pos`` (causal) and starts at or after ``key_end - window`` (window).
    Example: TILE_N 64, no window, one prefill tile of rows at positions 100..115, tiles [0, 2):
    tile 0 (keys 0-63) is mask-free, tile 1 (keys 64-127) straddles the diagonal: masked.
    """
    win_full = tl.where(window > 0, (tl.maximum(key_end - window, 0) + TILE_N - 1) // TILE_N, 0)
    full_lo = tl.minimum(tl.maximum(win_full, tile_lo), tile_hi)
    full_hi = tl.minimum(tl.maximum((first_pos + 1) // TILE_N, full_lo), tile_hi)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, win_lo, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off,
        tile_lo, full_lo, key_end, qk_scale, stride_cb, stride_cs,
        HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST, PRECISION, True,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, win_lo, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off,
        full_lo, full_hi, key_end, qk_scale, stride_cb, stride_cs,
        HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST, PRECISION, False,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_pos, win_lo, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off,
        full_hi, tile_hi, key_end, qk_scale, stride_cb, stride_cs,
        HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST, PRECISION, True,
    )  # fmt: skip
    return acc, l_i, m_i


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


# num_reqs and stride_bt (the block table's width: the step's longest request, in blocks)
# vary step by step: no specialization on them (Triton would compile one variant for 1, one
# for multiples of 16, one for the rest, and a step that meets a new one stalls for the
# compile, a second or more)
@triton.jit(
    do_not_specialize=["num_reqs", "stride_bt"],
    do_not_specialize_on_alignment=["qsl_ptr", "seq_lens_ptr", "bt_ptr"],
)
def _unified_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    bt_ptr,  # [num_reqs, max_blocks] int32
    qsl_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    num_reqs,
    qk_scale,
    window,  # 0 = no sliding window
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    G: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # BLOCK_M // G query tokens per tile
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    DECODE: tl.constexpr,  # every q_len <= 1: program r is request r's only tile
    scale_ptr=None,  # QUANT: [2, num_kv_heads] float32, an fp8 cache's K then V scales
    QUANT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    if DECODE:  # no search: its 9 dependent loads (256 requests) delay every program's start
        r = pid
    else:
        r = _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    local = pid - (q_start // BLOCK_Q + r)  # tile index within request r
    if DECODE:
        local = 0
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + r)
    ctx = seq_len - q_len  # tokens cached before this chunk

    q, q_pos, win_lo, tok, head, d, io_mask, first_pos, key_end, tile_lo, tile_hi = _query_tile(
        q_ptr, q_start, q_len, ctx, local, kvh, window, stride_qt, stride_qh,
        G, HEAD_DIM, HEAD_PAD, BLOCK_M, BLOCK_Q, TILE_N,
    )  # fmt: skip
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if QUANT:  # q . (k_fp8 * s_k) = (q . k_fp8) * s_k: K's scale joins the softmax scale
        qk_scale = qk_scale * tl.load(scale_ptr + kvh)
        q = _fp16_query(q, UPCAST)
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, q_pos, win_lo, k_cache_ptr, v_cache_ptr,
        bt_ptr + r.to(tl.int64) * stride_bt, kvh * stride_ch, tile_lo, tile_hi, first_pos, key_end,
        window, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST,
        PRECISION,
    )  # fmt: skip
    if QUANT:  # sum p (v_fp8 * s_v) = s_v * sum p v_fp8
        acc = acc * tl.load(scale_ptr + tl.num_programs(1) + kvh)
    _store_tile(out_ptr, acc, l_i, tok, head, d, io_mask, stride_ot, stride_oh)


@triton.jit(do_not_specialize=["stride_bt"])  # (see _unified_kernel)
def _split_kernel(
    part_acc_ptr,  # [num_reqs, num_heads, NUM_SPLITS, HEAD_PAD] fp32
    part_m_ptr,  # [num_reqs, num_heads, NUM_SPLITS] fp32
    part_l_ptr,  # [num_reqs, num_heads, NUM_SPLITS] fp32
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    qsl_ptr,
    seq_lens_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= G; rows = the G query heads of one decode token
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    scale_ptr=None,  # QUANT: [2, num_kv_heads] float32 (as the unified kernel's)
    QUANT: tl.constexpr = False,
):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    if q_len == 0:  # a padded request: nothing to do (the reduce skips it too)
        return
    seq_len = tl.load(seq_lens_ptr + r)

    m = tl.arange(0, BLOCK_M)
    head = kvh * G + m
    row_mask = m < G
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + q_start.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    pos = seq_len - 1  # the decode token's position
    q_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + pos
    win_lo = tl.where(window > 0, q_pos - window, -1)
    key_start = tl.maximum(tl.where(window > 0, pos - window + 1, 0), 0)
    all_lo = key_start // TILE_N
    all_hi = (seq_len + TILE_N - 1) // TILE_N
    # Split s takes tiles [all_lo + s * per, all_lo + (s + 1) * per) clipped to all_hi.
    # Example: 20 tiles, NUM_SPLITS 8 -> per 3: splits 0-5 get 3 tiles, 6 gets 2, 7 gets none.
    per = (all_hi - all_lo + NUM_SPLITS - 1) // NUM_SPLITS
    tile_lo = all_lo + s * per
    tile_hi = tl.minimum(tile_lo + per, all_hi)

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if QUANT:  # K's scale joins the softmax scale (see the unified kernel)
        qk_scale = qk_scale * tl.load(scale_ptr + kvh)
        q = _fp16_query(q, UPCAST)
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, q_pos, win_lo, k_cache_ptr, v_cache_ptr,
        bt_ptr + r.to(tl.int64) * stride_bt, kvh * stride_ch, tile_lo, tile_hi, pos, seq_len,
        window, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST,
        PRECISION,
    )  # fmt: skip
    if QUANT:  # every split's part times V's scale: the reduce's sums stay linear
        acc = acc * tl.load(scale_ptr + tl.num_programs(1) + kvh)
    # Example: NUM_HEADS 32, NUM_SPLITS 8, r 2, head 5, s 3 -> row (2 * 32 + 5) * 8 + 3.
    row = (r.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + s  # [BLOCK_M]
    tl.store(part_m_ptr + row, m_i, mask=row_mask)
    tl.store(part_l_ptr + row, l_i, mask=row_mask)
    tl.store(
        part_acc_ptr + row[:, None] * HEAD_PAD + d[None, :],
        acc,
        mask=row_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_reqs, num_heads, NUM_SPLITS, HEAD_PAD] fp32
    part_m_ptr,  # [num_reqs, num_heads, NUM_SPLITS] fp32
    part_l_ptr,
    qsl_ptr,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, with M = max_s m_s."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    if q_len == 0:
        return
    sp = tl.arange(0, NUM_SPLITS)
    row = (r.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS + sp  # [NUM_SPLITS]
    m_s = tl.load(part_m_ptr + row)
    l_s = tl.load(part_l_ptr + row)
    m_all = tl.max(m_s, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m_s - m_all)  # empty splits (m -inf) weigh 0
    denom = tl.sum(w * l_s, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_DIM
    acc = tl.load(  # [NUM_SPLITS, HEAD_PAD]; lanes >= HEAD_DIM were never written
        part_acc_ptr + row[:, None] * HEAD_PAD + d[None, :], mask=d_mask[None, :], other=0.0
    )
    out = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_ot + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # CPU interpreter: only steers the dispatch in tests


def choose_num_splits(
    num_reqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    device: torch.device,
    tile_n: int = 64,
) -> int:
    """Splits of the key sequence for the decode path; 1 means the unified kernel.

    Split only decode-only batches (max_query_len <= 1) whose (request, KV head) programs
    would leave the GPU under-filled (< 2 per SM): the largest power of two that keeps
    programs x splits <= 4 per SM, at most 64, and no more splits than key tiles. Example
    (132 SMs, 8 KV heads): batch 1 -> 8 programs -> 64 splits at 32k context, 8 at 512
    (8 tiles of 64 keys); batch 32 -> 256 programs -> 2 splits; batch 256 -> 1. The decode
    sweep of the GPU kernels benchmark (``benchmarks/README.md``) compares these with the
    fastest split count.
    For CUDA graphs the choice is baked in at capture: capture with max_seq_len = the model's
    max length (correctness never depends on the choice, only speed).
    """
    if max_query_len > 1:
        return 1
    programs = num_reqs * num_kv_heads
    sms = _num_sms(device)
    if programs >= 2 * sms:
        return 1
    want = max(1, (4 * sms) // programs)
    tiles = max(1, triton.cdiv(max_seq_len, tile_n))
    splits = min(64, want, tiles)
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of the attention kernels.

    ``block_m``: query rows per program of the unified kernel (query tokens x GQA group); the
    split kernel always uses max(16, next_pow2(G)) rows (one decode token's group).
    ``tile_n``: keys per inner-loop step. ``num_stages``: software-pipelining depth of the
    K/V loads (unified kernel; ``split_num_stages`` for the split-K kernel).
    """

    block_m: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 2
    split_num_stages: int = 3  # the split-K kernel's pipelining depth


# A chunk at least this long takes LONG_CHUNK_TILES on Hopper (see default_tile_config).
LONG_CHUNK = 2048
LONG_CHUNK_TILES = TileConfig(block_m=256, tile_n=64, num_warps=8, num_stages=3)


@functools.lru_cache(maxsize=8)
def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def default_tile_config(
    head_pad: int,
    decode: bool,
    max_query_len: int = 0,
    device: torch.device | None = None,
    itemsize: int = 2,
) -> TileConfig:
    """Defaults by head size and batch kind (decode-only batches get 16-row tiles; over an
    fp8 cache, ``itemsize`` 1, 128-key tiles).

    Picked by the GPU kernels benchmark's sweep (``benchmarks/README.md``; head_dim 128,
    GQA 4, bf16). A batch with a chunk of ``LONG_CHUNK`` tokens or more (head_dim <= 128,
    16-bit K/V - in float32 its stages need 263 KB of shared memory, a Hopper block may take
    227 - on Hopper) takes 256-row tiles over 8 warps, which reach more TFLOP/s on long
    chunks; shorter ones keep 64-row tiles, since a mixed step's decode rows each fill a tile
    of the unified kernel and 256-row tiles would waste 4x more.
    """
    tile_n = 64 if head_pad <= 128 else 32
    if decode:
        # fp8 caches (itemsize 1): 128 keys a tile, the bytes of 64 bf16 keys a loop step
        # (faster than 64: benchmarks/fp8_attn_micro.py)
        if itemsize == 1 and head_pad <= 128:
            tile_n = 128
        return TileConfig(block_m=16, tile_n=tile_n)
    if head_pad <= 128:
        long = max_query_len >= LONG_CHUNK and itemsize <= 2
        if long and device is not None and _is_hopper(device):
            return LONG_CHUNK_TILES
        return TileConfig(block_m=64, tile_n=tile_n, num_stages=3)
    return TileConfig(block_m=32, tile_n=tile_n)


def unified_block_m(cfg: TileConfig, g: int, max_query_len: int, tuned: bool = False) -> int:
    """The unified kernel's query rows x heads per tile (``BLOCK_M``) for a step whose longest
    row has ``max_query_len`` tokens, G query heads per KV head."""
    block_m = max(cfg.block_m, triton.next_power_of_2(g))
    if max_query_len > 1 and not tuned and max_query_len * g < block_m:
        # short rows (speculative decoding: a token and its k drafts; a prompt's last few
        # tokens beside decode rows): a tile just big enough for one row's query tokens x
        # heads, not 64 rows of which most would be masked.
        # Example: 5-token rows, G 2 -> block_m 16 (BLOCK_Q 8); G 4 -> 32 (BLOCK_Q 8)
        block_m = max(16, triton.next_power_of_2(max_query_len * g))
    return block_m


def prefill_variant_query_lens(
    head_dim: int, g: int, device: torch.device, itemsize: int, max_len: int
) -> list[int]:
    """One longest-row length per variant of the unified kernel that steps with prompt tokens
    can meet (its tile shape is a compile-time constant), up to ``max_len`` tokens: a step
    that meets a variant no step met before stalls for a Triton compile (a second or more),
    so the runner runs each once at start-up (``KVCacheLayout.capture_graphs``).

    Example (head_dim 128, G 2, Hopper, 16-bit cache): [2, 9, 17, 2048] -> tiles of 16, 32,
    64 and 256 rows (the last: chunks of ``LONG_CHUNK`` tokens or more)."""
    head_pad = max(16, triton.next_power_of_2(head_dim))
    seen: dict[tuple, int] = {}
    for q in range(2, max_len + 1):
        cfg = default_tile_config(head_pad, False, q, device, itemsize)
        seen.setdefault((unified_block_m(cfg, g, q), cfg), q)
    return sorted(seen.values())


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,  # force a path: 1 = unified, > 1 (power of 2) = split-K
    tile_config: TileConfig | None = None,  # override the launch shape (tuning)
    kv_scale: torch.Tensor | None = None,  # [2, num_kv_heads] float32: an fp8 cache's scales
) -> torch.Tensor:
    """Causal paged attention for a flattened mixed batch; returns [num_tokens, H, D].

    Dispatch (host ints only): decode-only batches that under-fill the GPU take the split-K
    path (see :func:`choose_num_splits`), everything else the unified kernel. Rows past
    ``query_start_loc[-1]`` are left as they were in ``out``. An fp8 cache
    (``torch.float8_e4m3fn``) is read as fp8 * ``kv_scale``: K and V converted to float16 in
    registers (the query too), K's scale folded into the softmax scale, V's applied to each
    program's output.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    assert kv_cache.shape[0] == 2 and kv_cache.shape[4] == head_dim
    assert num_heads % num_kv_heads == 0
    g = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    assert out.stride(2) == 1
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    quant = is_fp8(kv_cache.dtype)
    if quant and (kv_scale is None or kv_scale.shape != (2, num_kv_heads)):
        raise ValueError("paged_attention: an fp8 cache needs kv_scale [2, num_kv_heads]")
    scales = {"scale_ptr": kv_scale, "QUANT": True} if quant else {}
    window = int(sliding_window) if sliding_window else 0
    qk_scale = float(scale) * LOG2E
    head_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 on a GPU
    upcast = query.device.type == "cpu"
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    decode = max_query_len <= 1
    cfg = tile_config or default_tile_config(
        head_pad, decode, max_query_len, query.device, kv_cache.element_size()
    )
    if num_splits is None:
        num_splits = choose_num_splits(
            num_reqs, num_kv_heads, max_query_len, max_seq_len, query.device, cfg.tile_n
        )
    block_m = unified_block_m(cfg, g, max_query_len, tuned=tile_config is not None)
    tile_n = cfg.tile_n

    if num_splits > 1:
        assert decode, "the split-K path takes decode-only batches (max_query_len <= 1)"
        assert num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
        part_acc = torch.empty(
            (num_reqs, num_heads, num_splits, head_pad), dtype=torch.float32, device=query.device
        )
        part_m = torch.empty(
            (num_reqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        part_l = torch.empty_like(part_m)
        _split_kernel[(num_reqs, num_kv_heads, num_splits)](
            part_acc, part_m, part_l, query, k_cache, v_cache, block_tables, query_start_loc,
            seq_lens, qk_scale, window, query.stride(0), query.stride(1), block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), NUM_HEADS=num_heads,
            NUM_SPLITS=num_splits, G=g, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            BLOCK_SIZE=block_size, BLOCK_M=max(16, triton.next_power_of_2(g)), TILE_N=tile_n,
            UPCAST=upcast, PRECISION=precision, num_warps=cfg.num_warps,
            num_stages=cfg.split_num_stages, **scales,
        )  # fmt: skip
        _reduce_kernel[(num_reqs, num_heads)](
            out, part_acc, part_m, part_l, query_start_loc, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            num_warps=4 if head_pad >= 128 else 2,
        )  # fmt: skip
        return out

    block_q = block_m // g
    # Upper bound on the tiles of all requests (see _find_request); decode: one per request.
    grid = (num_reqs if decode else num_tokens // block_q + num_reqs, num_kv_heads)
    _unified_kernel[grid](
        out, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, num_reqs, qk_scale,
        window, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), G=g,
        HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_Q=block_q, TILE_N=tile_n, UPCAST=upcast, PRECISION=precision, DECODE=decode,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **scales,
    )  # fmt: skip
    return out


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1]
    seq_lens: torch.Tensor,  # [num_reqs]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks]
    scale: float,
    sliding_window: int | None = None,
    kv_scale: torch.Tensor | None = None,  # [2, num_kv_heads]: an fp8 cache's scales
) -> torch.Tensor:
    """Plain PyTorch reference in float32, one request at a time; returns [num_tokens, H, D]
    float32 (rows of no request are 0). Slow and simple on purpose. An fp8 cache reads as
    fp8 * ``kv_scale``."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    g = num_heads // num_kv_heads
    k_flat = kv_cache[0].reshape(-1, num_kv_heads, head_dim)
    v_flat = kv_cache[1].reshape(-1, num_kv_heads, head_dim)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.long()
    k_scale, v_scale = (kv_scale[0], kv_scale[1]) if kv_scale is not None else (None, None)
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
    for r, seq_len in enumerate(lens):
        start, end = qsl[r], qsl[r + 1]
        if end == start:
            continue
        k_pos = torch.arange(seq_len, device=query.device)
        # Example: block_size 4, table [7, 2], positions [0..5] -> slots [28..31, 8, 9]
        slots = tables[r, k_pos // block_size] * block_size + k_pos % block_size
        k = dequantize(k_flat[slots], k_scale, torch.float32)  # [seq_len, num_kv_heads, D]
        v = dequantize(v_flat[slots], v_scale, torch.float32)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [seq_len, H, D]
        q = query[start:end].float()  # [q_len, H, D]
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        vis = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        if sliding_window:
            vis &= k_pos[None, :] > q_pos[:, None] - sliding_window
        s = torch.einsum("nhd,lhd->hnl", q, k) * scale
        s = s.masked_fill(~vis[None], float("-inf"))
        out[start:end] = torch.einsum("hnl,lhd->nhd", s.softmax(dim=-1), v)
    return out
