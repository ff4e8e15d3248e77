"""The scores of a prompt's keys from its last queries (the observation window), over
KV-Compress's per-head paged cache (layout: :mod:`pagedllm.ops.kvc_attention`): one program
per (scoring request, KV head, key tile), every scoring request of a step in one launch, from
the softmax normalizers the prefill kernel stored (:mod:`.prefill`), and one more launch for
the max-pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops.kvc_attention.common import HeadCacheArgs, _load_rows, _qk, _tile_keys


@triton.jit
def _window_program(win_reqs_ptr, lens_ptr, stride_lr, stride_lh):
    """A window program's (request index, KV head, key tile, table row, head length): the
    window kernels run one program per (scoring request, KV head, key tile)."""
    w = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    trow = tl.load(win_reqs_ptr + w).to(tl.int64)
    seq_len = tl.load(lens_ptr + trow * stride_lr + kvh * stride_lh).to(tl.int32)
    return w, kvh, tile, trow, seq_len


@triton.jit
def _window_keys(bt_ptr, trow, kvh, tile, seq_len, stride_br, stride_bh,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):  # fmt: skip
    """A window program's key tile: its logical indices j [TILE_N], which of them the head
    holds, their block ids and offsets (table columns contiguous)."""
    j = tile * TILE_N + tl.arange(0, TILE_N)
    bt_row = bt_ptr + trow * stride_br + kvh * stride_bh
    j_ok, blk, off = _tile_keys(bt_row, 1, tile, 0, seq_len, BLOCK_SIZE, TILE_N, True)
    return j, j_ok, blk, off


# The window requests' count and the longest head vary step by step (views of one shipped
# buffer at any offset): no specialization on them.
@triton.jit(
    do_not_specialize=["max_len"],
    do_not_specialize_on_alignment=["win_reqs_ptr", "win_rows_ptr", "win_n_ptr"],
)
def _window_score_kernel(
    metric_ptr,  # [W, num_kv_heads, max_len] float32 (POOL) - else unused
    scores_ptr,  # [num_slots] float32 (not POOL: += here)
    q_ptr,  # [num_tokens, num_heads, head_dim]
    lse_ptr,  # [num_tokens, num_heads] float32: the rows' log2-sum-exp2
    k_cache_ptr,  # [num_blocks, block_size, head_dim]
    bt_ptr,  # [rows, num_kv_heads, max_blocks] int32
    lens_ptr,  # [rows, num_kv_heads]
    win_reqs_ptr,  # [W]: each scoring request's table row
    win_rows_ptr,  # [W, C]: its window queries' rows of the step (the first n valid)
    win_n_ptr,  # [W]: its window queries
    max_len,  # a bound on the heads' lengths (the metric's last dimension)
    qk_scale,
    stride_qt,
    stride_qh,
    stride_lse,
    stride_br,
    stride_bh,
    stride_lr,
    stride_lh,
    stride_cb,
    stride_cs,
    C: tl.constexpr,  # window_rows' row length
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows (window query x query head) a dot takes
    TILE_N: tl.constexpr,
    POOL: tl.constexpr,  # True: write the metric for _window_pool_kernel; False: add it
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program per (scoring request, KV head, key tile): the squared softmax probability
    of each of the tile's keys, summed over the request's window queries and the KV head's G
    query heads (``prefill_window_scores_batched``'s metric), from the probabilities'
    normalizers the prefill kernel stored (``lse``): one pass over the keys, no softmax over
    the whole row here.

    Window query i (of n) sits at logical index ``len - n + i`` of the head and sees the
    indices up to it. Rows m of a dot: window query ``m // G``, query head ``kvh * G + m % G``.
    Example: C 32, G 4 -> 128 rows, BLOCK_M 128: one dot a tile; n 20 -> rows 80.. masked."""
    w, kvh, tile, trow, seq_len = _window_program(win_reqs_ptr, lens_ptr, stride_lr, stride_lh)
    if tile * TILE_N >= seq_len:
        return
    n = tl.load(win_n_ptr + w).to(tl.int32)
    j, j_ok, blk, off = _window_keys(bt_ptr, trow, kvh, tile, seq_len, stride_br, stride_bh,
                                     BLOCK_SIZE, TILE_N)  # fmt: skip
    k = _load_rows(k_cache_ptr, blk, off, j_ok, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, True)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    metric = tl.zeros([TILE_N], dtype=tl.float32)
    for r0 in tl.static_range(0, C * G, BLOCK_M):
        m = r0 + tl.arange(0, BLOCK_M)
        qi = m // G  # window query of each row
        row_ok = (m < C * G) & (qi < n)
        tok = tl.load(win_rows_ptr + w * C + qi, mask=row_ok, other=0).to(tl.int64)
        head = kvh * G + m % G
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        lse = tl.load(lse_ptr + tok * stride_lse + head, mask=row_ok, other=0.0)
        s = _qk(q, k, j_ok, qk_scale, UPCAST, PRECISION, True)  # -inf past the head's keys
        q_idx = seq_len - n + qi  # [BLOCK_M] each row's own logical index
        vis = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= q_idx[:, None])
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        metric += tl.sum(p * p, axis=0)
    if POOL:
        tl.store(metric_ptr + (w * tl.num_programs(1) + kvh).to(tl.int64) * max_len + j, metric,
                 mask=j_ok)  # fmt: skip
    else:
        tl.atomic_add(scores_ptr + blk * BLOCK_SIZE + off, metric, mask=j_ok)


@triton.jit(
    do_not_specialize=["max_len"],
    do_not_specialize_on_alignment=["win_reqs_ptr"],
)
def _window_pool_kernel(
    scores_ptr,  # [num_slots] float32
    metric_ptr,  # [W, num_kv_heads, max_len] float32 (_window_score_kernel's)
    bt_ptr,
    lens_ptr,
    win_reqs_ptr,
    max_len,
    stride_br,
    stride_bh,
    stride_lr,
    stride_lh,
    KERNEL: tl.constexpr,  # the max-pool's width (odd: centred)
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
):
    """One program per (scoring request, KV head, key tile): each key's metric max-pooled over
    the ``KERNEL`` logical indices around it (``maxpool_scores``: indices past the head's
    length count as 0, below any metric) and added to its slot's score.
    Example: KERNEL 7, index 2 of a head of 10 -> the max over indices 0..5."""
    w, kvh, tile, trow, seq_len = _window_program(win_reqs_ptr, lens_ptr, stride_lr, stride_lh)
    if tile * TILE_N >= seq_len:
        return
    j, j_ok, blk, off = _window_keys(bt_ptr, trow, kvh, tile, seq_len, stride_br, stride_bh,
                                     BLOCK_SIZE, TILE_N)  # fmt: skip
    base = metric_ptr + (w * tl.num_programs(1) + kvh).to(tl.int64) * max_len
    best = tl.zeros([TILE_N], dtype=tl.float32)
    for o in tl.static_range(KERNEL):
        u = j + (o - KERNEL // 2)
        best = tl.maximum(best, tl.load(base + u, mask=(u >= 0) & (u < seq_len), other=0.0))
    tl.atomic_add(scores_ptr + blk * BLOCK_SIZE + off, best, mask=j_ok)


def kvc_window_scores(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] the step's queries
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, head_dim]
    lse: torch.Tensor,  # [num_tokens, num_heads] float32 (kvc_paged_attention's)
    block_tables: torch.Tensor,  # [rows, num_kv_heads, max_blocks] int32
    seq_lens: torch.Tensor,  # [rows, num_kv_heads]
    window_reqs: torch.Tensor,  # [W]: the scoring requests' table rows
    window_rows: torch.Tensor,  # [W, C]: their window queries' rows (the first n valid)
    window_n: torch.Tensor,  # [W]: window queries of each (n <= C)
    scale: float,
    scores: torch.Tensor,  # [num_slots] float32, += the (pooled) metric
    maxpool_kernel: int,
    max_len: int,  # a host bound on the requests' head lengths
) -> None:
    """The prompt's scores (``prefill_window_scores_batched``) of every chunk that ends its
    prompt in a step, with no host sync and no [requests, heads, queries, keys] tensor: a
    request's window queries are its last ``n`` rows, whose softmax normalizers the prefill
    kernel stored in ``lse``; query i of them sees its head's logical indices up to
    ``len - n + i`` (full-attention layers). One launch for the metric, and one for the
    max-pool when ``maxpool_kernel`` > 1. Example: n 2 at rows 40, 41, a head of length 10 ->
    they see the indices <= 8 and <= 9."""
    num_w, c = window_rows.shape
    if num_w == 0 or max_len <= 0:
        return
    cache = HeadCacheArgs.of(query, kv_cache, block_tables, seq_lens, scale)
    num_kv_heads = cache.num_kv_heads
    g = query.shape[1] // num_kv_heads
    assert scores.dtype == torch.float32 and scores.is_contiguous()
    assert lse.dtype == torch.float32 and lse.stride(1) == 1 and query.stride(2) == 1
    assert block_tables.stride(2) == 1 and window_rows.is_contiguous()
    tile_n = 64
    block_m = min(128, max(16, triton.next_power_of_2(c * g)))
    pool = maxpool_kernel > 1
    metric = (
        torch.empty((num_w, num_kv_heads, max_len), dtype=torch.float32, device=query.device)
        if pool
        else scores  # never read without POOL
    )
    grid = (num_w, num_kv_heads, triton.cdiv(max_len, tile_n))
    _window_score_kernel[grid](
        metric, scores, query, lse, cache.k_cache, block_tables, seq_lens, window_reqs,
        window_rows, window_n, max_len, cache.qk_scale, query.stride(0), query.stride(1),
        lse.stride(0), *cache.strides(), C=c, G=g, BLOCK_M=block_m, TILE_N=tile_n, POOL=pool,
        num_warps=4, **cache.consts(),
    )  # fmt: skip
    if pool:
        _window_pool_kernel[grid](
            scores, metric, block_tables, seq_lens, window_reqs, max_len,
            *cache.strides(cache=False), KERNEL=maxpool_kernel, BLOCK_SIZE=cache.block_size,
            TILE_N=tile_n, num_warps=2,
        )  # fmt: skip
