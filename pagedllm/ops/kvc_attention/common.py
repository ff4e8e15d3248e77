"""Device code shared by the KV-Compress kernels of this package: one (row, KV head)'s keys
read tile by tile through its own block table, the online softmax and the score pass over a
range of tiles, and what a decode program of (row, KV head) starts from.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# The step's index tensors (table rows, query rows) are views at any offset of one shipped
# buffer: no specialization on their alignment, or a mixed step's decode rows would meet new
# kernel variants (a Triton compile each, seconds) long after the warm-up.
_INDEX_PTRS = ["row_ids_ptr", "q_rows_ptr", "scored_ptr"]


@triton.jit
def _tile_keys(
    bt_ptr,  # the (row, KV head)'s block table
    stride_bb,
    tile,
    key_lo,  # first visible logical index
    key_hi,  # one past the last visible logical index (the head's length)
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,  # False: every index of the tile is in [key_lo, key_hi)
):
    """Logical indices of one tile: (visible [TILE_N] bool, block id [TILE_N] int64, offset).

    Example: BLOCK_SIZE 16, TILE_N 32, tile 2 -> indices 64..95 -> table columns 4 and 5,
    offsets 0..15 twice.
    """
    j = tile * TILE_N + tl.arange(0, TILE_N)
    ok = (j >= key_lo) & (j < key_hi)
    if MASKED:
        blk = tl.load(bt_ptr + (j // BLOCK_SIZE) * stride_bb, mask=ok, other=0)
    else:
        blk = tl.load(bt_ptr + (j // BLOCK_SIZE) * stride_bb)
    return ok, blk.to(tl.int64), j % BLOCK_SIZE


@triton.jit
def _load_rows(
    cache_ptr,  # K or V cache [num_blocks, block_size, head_dim]
    blk,  # [TILE_N] int64
    off,  # [TILE_N]
    ok,  # [TILE_N] bool
    stride_cb,
    stride_cs,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The [TILE_N, HEAD_PAD] K or V rows at (blk, off); 0 where masked or past HEAD_DIM."""
    d = tl.arange(0, HEAD_PAD)
    ptrs = cache_ptr + (blk * stride_cb + off * stride_cs)[:, None] + d[None, :]
    if MASKED:
        x = tl.load(ptrs, mask=ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    elif HEAD_PAD == HEAD_DIM:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(d < HEAD_DIM)[None, :], other=0.0)
    return x


@triton.jit
def _qk(
    q,  # [BLOCK_M, HEAD_PAD]
    k,  # [TILE_N, HEAD_PAD]
    ok,  # [TILE_N] bool
    qk_scale,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Logits in log2 units [BLOCK_M, TILE_N]; -inf for keys not visible."""
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PRECISION)
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
    s = s * qk_scale
    if MASKED:
        s = tl.where(ok[None, :], s, float("-inf"))
    return s


@triton.jit
def _full_tiles(tile_lo, tile_hi, key_lo, key_hi, TILE_N: tl.constexpr):
    """[full_lo, full_hi) within [tile_lo, tile_hi): the tiles wholly inside [key_lo, key_hi).

    Example: TILE_N 64, keys [5, 200), tiles [0, 4) -> full [1, 3): tiles 0 and 3 are masked.
    """
    full_lo = tl.minimum(tl.maximum((key_lo + TILE_N - 1) // TILE_N, tile_lo), tile_hi)
    full_hi = tl.minimum(tl.maximum(key_hi // TILE_N, full_lo), tile_hi)
    return full_lo, full_hi


@triton.jit
def _attend_tiles(
    acc,  # [BLOCK_M, HEAD_PAD] fp32 un-normalised output
    l_i,  # [BLOCK_M] fp32 running sum of exp2
    m_i,  # [BLOCK_M] fp32 running max (log2 units)
    q,  # [BLOCK_M, HEAD_PAD]
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    stride_bb,
    tile_lo,
    tile_hi,
    key_lo,
    key_hi,
    qk_scale,
    stride_cb,
    stride_cs,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Online softmax over tiles ``[tile_lo, tile_hi)``; returns the updated (acc, l, m)."""
    for tile in range(tile_lo, tile_hi):
        ok, blk, off = _tile_keys(bt_ptr, stride_bb, tile, key_lo, key_hi, BLOCK_SIZE, TILE_N,
                                  MASKED)  # fmt: skip
        k = _load_rows(k_cache_ptr, blk, off, ok, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, MASKED)
        v = _load_rows(v_cache_ptr, blk, off, ok, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, MASKED)
        s = _qk(q, k, ok, qk_scale, UPCAST, PRECISION, MASKED)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no visible key yet keeps max -inf: use 0 so that exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_range(
    acc,
    l_i,
    m_i,
    q,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    stride_bb,
    tile_lo,
    tile_hi,
    key_lo,
    key_hi,
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
    """Tiles ``[tile_lo, tile_hi)`` in three runs: masked, mask-free, masked."""
    full_lo, full_hi = _full_tiles(tile_lo, tile_hi, key_lo, key_hi, TILE_N)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_ptr, stride_bb, tile_lo, full_lo, key_lo,
        key_hi, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST,
        PRECISION, True,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_ptr, stride_bb, full_lo, full_hi, key_lo,
        key_hi, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST,
        PRECISION, False,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_ptr, stride_bb, full_hi, tile_hi, key_lo,
        key_hi, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST,
        PRECISION, True,
    )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _score_tiles(
    q,  # [BLOCK_M, HEAD_PAD]
    m_fin,  # [BLOCK_M] fp32 final max (log2 units; 0 for rows with no key)
    inv_l,  # [BLOCK_M] fp32 1 / final sum; 0 for padding rows (they add nothing)
    scores_ptr,  # [num_blocks * block_size] fp32
    k_cache_ptr,
    bt_ptr,
    stride_bb,
    tile_lo,
    tile_hi,
    key_lo,
    key_hi,
    qk_scale,
    stride_cb,
    stride_cs,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
):
    """scores[slot] += sum over the rows of p^2, p = 2^(s - m_fin) / l, for tiles
    ``[tile_lo, tile_hi)``."""
    for tile in range(tile_lo, tile_hi):
        ok, blk, off = _tile_keys(bt_ptr, stride_bb, tile, key_lo, key_hi, BLOCK_SIZE, TILE_N,
                                  MASKED)  # fmt: skip
        k = _load_rows(k_cache_ptr, blk, off, ok, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, MASKED)
        s = _qk(q, k, ok, qk_scale, UPCAST, PRECISION, MASKED)
        p = tl.exp2(s - m_fin[:, None]) * inv_l[:, None]  # [BLOCK_M, TILE_N]
        p2 = tl.sum(p * p, axis=0)  # [TILE_N]
        slot = blk * BLOCK_SIZE + off
        if MASKED:
            old = tl.load(scores_ptr + slot, mask=ok, other=0.0)
            tl.store(scores_ptr + slot, old + p2, mask=ok)
        else:
            old = tl.load(scores_ptr + slot)
            tl.store(scores_ptr + slot, old + p2)


@triton.jit
def _score_range(
    q,
    m_fin,
    inv_l,
    scores_ptr,
    k_cache_ptr,
    bt_ptr,
    stride_bb,
    tile_lo,
    tile_hi,
    key_lo,
    key_hi,
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
    """:func:`_score_tiles` in three runs: masked, mask-free, masked."""
    full_lo, full_hi = _full_tiles(tile_lo, tile_hi, key_lo, key_hi, TILE_N)
    _score_tiles(
        q, m_fin, inv_l, scores_ptr, k_cache_ptr, bt_ptr, stride_bb, tile_lo, full_lo, key_lo,
        key_hi, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST,
        PRECISION, True,
    )  # fmt: skip
    _score_tiles(
        q, m_fin, inv_l, scores_ptr, k_cache_ptr, bt_ptr, stride_bb, full_lo, full_hi, key_lo,
        key_hi, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST,
        PRECISION, False,
    )  # fmt: skip
    _score_tiles(
        q, m_fin, inv_l, scores_ptr, k_cache_ptr, bt_ptr, stride_bb, full_hi, tile_hi, key_lo,
        key_hi, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST,
        PRECISION, True,
    )  # fmt: skip


@triton.jit
def _out_row(q_rows_ptr, row, Q_ROWS: tl.constexpr):
    """The query / output row of decode row ``row``: ``q_rows[row]`` with Q_ROWS (a mixed
    step's decode rows, read in place), else ``row`` itself (int64)."""
    if Q_ROWS:
        return tl.load(q_rows_ptr + row).to(tl.int64)
    return row.to(tl.int64)


@triton.jit
def _group_setup(
    q_ptr,
    bt_ptr,
    lens_ptr,
    row_ids_ptr,  # [rows] int64: the table/length row of each query row
    q_rows_ptr,  # [rows] int64: the query (and output) row of each row (read with Q_ROWS)
    row,
    kvh,
    window,  # 0 = no sliding window
    stride_qt,
    stride_qh,
    stride_br,
    stride_bh,
    stride_lr,
    stride_lh,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    Q_ROWS: tl.constexpr,  # False: row ``row`` of the query is the row's (``q_rows`` unread)
):
    """What every decode program of (row, kvh) starts from: the group's query rows
    [BLOCK_M, HEAD_PAD] (row m = query head kvh * G + m; rows >= G are 0), the row mask, the
    head's block-table pointer (table row ``row_ids[row]``), the visible logical indices
    [key_lo, key_hi), their tiles [tile_lo, tile_hi) and the query row (``q_rows[row]`` with
    Q_ROWS, else ``row``; int64)."""
    m = tl.arange(0, BLOCK_M)
    row_mask = m < G
    d = tl.arange(0, HEAD_PAD)
    head = kvh * G + m
    qrow = _out_row(q_rows_ptr, row, Q_ROWS)
    q = tl.load(
        q_ptr + qrow * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    trow = tl.load(row_ids_ptr + row).to(tl.int64)
    bt_row = bt_ptr + trow * stride_br + kvh * stride_bh
    key_hi = tl.load(lens_ptr + trow * stride_lr + kvh * stride_lh).to(tl.int32)
    key_lo = tl.maximum(tl.where(window > 0, key_hi - window, 0), 0)
    tile_lo = key_lo // TILE_N
    tile_hi = (key_hi + TILE_N - 1) // TILE_N
    return q, row_mask, head, bt_row, key_lo, key_hi, tile_lo, tile_hi, qrow


@triton.jit
def _scored_tiles(scored_ptr, row_ids_ptr, row, tile_lo, tile_hi, ROW_FLAGS: tl.constexpr):
    """The end of the tiles the score pass covers: ``tile_hi``, or ``tile_lo`` (none) for a
    row whose table row's ``scored`` flag is 0 (with ROW_FLAGS)."""
    if ROW_FLAGS:
        flag = tl.load(scored_ptr + tl.load(row_ids_ptr + row))
        tile_hi = tl.where(flag != 0, tile_hi, tile_lo)
    return tile_hi


@triton.jit
def _split_tiles(tile_lo, tile_hi, s, NUM_SPLITS: tl.constexpr, MIN_TILES: tl.constexpr):
    """Split s's share of tiles [tile_lo, tile_hi): equal slices of at least MIN_TILES tiles,
    the last ones shorter or empty.

    Example: 20 tiles, NUM_SPLITS 8 -> per 3: splits 0-5 get 3 tiles, 6 gets 2, 7 none. With
    MIN_TILES 8 -> per 8: splits 0-1 get 8, 2 gets 4, 3-7 none; a head of 5 tiles is split 0's
    alone. (KV-Compress leaves a request's heads uneven: a layer's few long heads are split
    into more splits than its short ones.)
    """
    per = tl.maximum((tile_hi - tile_lo + NUM_SPLITS - 1) // NUM_SPLITS, MIN_TILES)
    lo = tl.minimum(tile_lo + s * per, tile_hi)
    return lo, tl.minimum(lo + per, tile_hi)


@triton.jit
def _store_partial(
    part_acc_ptr, part_m_ptr, part_l_ptr, prow, acc, m_i, l_i, row_mask, busy,
    HEAD_PAD: tl.constexpr,
):  # fmt: skip
    """A split's partial (max, sum, and acc where it had keys) at part rows ``prow``."""
    tl.store(part_m_ptr + prow, m_i, mask=row_mask)
    tl.store(part_l_ptr + prow, l_i, mask=row_mask)
    d = tl.arange(0, HEAD_PAD)
    tl.store(part_acc_ptr + prow[:, None] * HEAD_PAD + d[None, :], acc, mask=busy[:, None])


@triton.jit
def _used_splits(tile_lo, tile_hi, NUM_SPLITS: tl.constexpr, MIN_TILES: tl.constexpr):
    """How many of ``_split_tiles``'s splits have tiles (at least 1).
    Example: 20 tiles, NUM_SPLITS 8, MIN_TILES 1 -> per 3 -> 7; MIN_TILES 8 -> per 8 -> 3."""
    n = tile_hi - tile_lo
    per = tl.maximum((n + NUM_SPLITS - 1) // NUM_SPLITS, MIN_TILES)
    return tl.maximum((n + per - 1) // per, 1)
