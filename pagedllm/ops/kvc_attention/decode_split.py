"""Split-K decode over KV-Compress's per-head paged cache: the split, combine and score
kernels, and the persistent kernels that finish the long heads of a single pass.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.ops.kvc_attention.common import (
    _INDEX_PTRS,
    _attend_range,
    _group_setup,
    _out_row,
    _score_range,
    _scored_tiles,
    _split_tiles,
    _store_partial,
)


@triton.jit
def _split_program(
    row,
    kvh,
    s,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    lens_ptr,
    row_ids_ptr,
    q_rows_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_br,
    stride_bh,
    stride_bb,
    stride_lr,
    stride_lh,
    stride_cb,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    Q_ROWS: tl.constexpr,
    MIN_TILES: tl.constexpr,
):
    """Split ``s`` of (row, KV head): its partial (acc, max, sum) per query head; an empty
    split writes (-inf, 0) and no acc (the combine does not read it)."""
    q, row_mask, head, bt_row, key_lo, key_hi, tile_lo, tile_hi, qrow = _group_setup(
        q_ptr, bt_ptr, lens_ptr, row_ids_ptr, q_rows_ptr, row, kvh, window, stride_qt,
        stride_qh, stride_br, stride_bh, stride_lr, stride_lh, G, HEAD_DIM, HEAD_PAD, BLOCK_M,
        TILE_N, Q_ROWS,
    )  # fmt: skip
    tile_lo, tile_hi = _split_tiles(tile_lo, tile_hi, s, NUM_SPLITS, MIN_TILES)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, stride_bb, tile_lo, tile_hi, key_lo,
        key_hi, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST,
        PRECISION,
    )  # fmt: skip
    # Example: NUM_HEADS 8, NUM_SPLITS 4, row 2, head 5, split 3 -> part row (2 * 8 + 5) * 4 + 3.
    prow = (row.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + s  # [BLOCK_M]
    busy = row_mask & (tile_lo < tile_hi)
    _store_partial(part_acc_ptr, part_m_ptr, part_l_ptr, prow, acc, m_i, l_i, row_mask, busy,
                   HEAD_PAD)  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=["row_ids_ptr", "q_rows_ptr"])
def _split_kernel(
    part_acc_ptr,  # [rows, num_heads, NUM_SPLITS, HEAD_PAD] fp32
    part_m_ptr,  # [rows, num_heads, NUM_SPLITS] fp32
    part_l_ptr,  # [rows, num_heads, NUM_SPLITS] fp32
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    lens_ptr,
    row_ids_ptr,
    q_rows_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_br,
    stride_bh,
    stride_bb,
    stride_lr,
    stride_lh,
    stride_cb,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    Q_ROWS: tl.constexpr,
    MIN_TILES: tl.constexpr,
):
    """One program per (row, KV head, split): ``_split_program``."""
    _split_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), part_acc_ptr, part_m_ptr,
        part_l_ptr, q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr, q_rows_ptr,
        qk_scale, window, stride_qt, stride_qh, stride_br, stride_bh, stride_bb, stride_lr,
        stride_lh, stride_cb, stride_cs, NUM_HEADS, NUM_SPLITS, G, HEAD_DIM, HEAD_PAD,
        BLOCK_SIZE, BLOCK_M, TILE_N, UPCAST, PRECISION, Q_ROWS, MIN_TILES,
    )  # fmt: skip


@triton.jit
def _combine_head(
    out_ptr,
    glob_m_ptr,
    glob_l_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    base,  # row * NUM_HEADS + query head (int64): the head's partials' row
    orow,  # its output row (int64)
    h,  # the query head
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    STORE_ML: tl.constexpr,
):
    """One query head's S partials: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,
    M = max_s m_s; with STORE_ML, M (0 if no key) and the sum (1 if none) for the score
    pass."""
    sp = tl.arange(0, SPLIT_PAD)
    sp_mask = sp < NUM_SPLITS
    prow = base * NUM_SPLITS + sp  # [SPLIT_PAD]
    l_s = tl.load(part_l_ptr + prow, mask=sp_mask, other=0.0)
    m_s = tl.load(part_m_ptr + prow, mask=sp_mask, other=float("-inf"))
    m_all = tl.max(m_s, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m_s - m_all)  # empty splits (m -inf) weigh 0
    denom = tl.sum(w * l_s, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_DIM
    busy = sp_mask & (m_s != float("-inf"))  # an empty split wrote no acc (weight 0)
    acc = tl.load(  # [SPLIT_PAD, HEAD_PAD]
        part_acc_ptr + prow[:, None] * HEAD_PAD + d[None, :],
        mask=busy[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(
        out_ptr + orow * stride_ot + h * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )
    if STORE_ML:
        tl.store(glob_m_ptr + base, m_all)
        tl.store(glob_l_ptr + base, denom)


@triton.jit(do_not_specialize_on_alignment=["q_rows_ptr"])
def _combine_kernel(
    out_ptr,  # [rows, num_heads, head_dim]
    glob_m_ptr,  # [rows, num_heads] fp32: the combined max (0 if no key), for the score pass
    glob_l_ptr,  # [rows, num_heads] fp32: the combined sum (1 if no key)
    part_acc_ptr,  # [rows, num_heads, NUM_SPLITS, HEAD_PAD] fp32
    part_m_ptr,  # [rows, num_heads, NUM_SPLITS] fp32
    part_l_ptr,
    q_rows_ptr,  # [rows] int64: the output row of each row (read with Q_ROWS)
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_PAD: tl.constexpr,  # next power of two >= NUM_SPLITS
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    STORE_ML: tl.constexpr,
    Q_ROWS: tl.constexpr,
):
    """One program per (row, query head): ``_combine_head``, written to output row
    ``q_rows[row]`` (Q_ROWS) or ``row``."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    orow = _out_row(q_rows_ptr, row, Q_ROWS)
    _combine_head(
        out_ptr, glob_m_ptr, glob_l_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
        row.to(tl.int64) * NUM_HEADS + h, orow, h, stride_ot, stride_oh, NUM_SPLITS, SPLIT_PAD,
        HEAD_DIM, HEAD_PAD, STORE_ML,
    )  # fmt: skip


@triton.jit
def _split_score_program(
    row,
    kvh,
    s,
    scores_ptr,
    scored_ptr,
    glob_m_ptr,
    glob_l_ptr,
    q_ptr,
    k_cache_ptr,
    bt_ptr,
    lens_ptr,
    row_ids_ptr,
    q_rows_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_br,
    stride_bh,
    stride_bb,
    stride_lr,
    stride_lh,
    stride_cb,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    ROW_FLAGS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    Q_ROWS: tl.constexpr,
    MIN_TILES: tl.constexpr,
):
    """Split ``s`` of (row, KV head): its keys' scores from the combined max and sum (the
    same tiles as the split's ``_split_program``)."""
    q, row_mask, head, bt_row, key_lo, key_hi, tile_lo, tile_hi, qrow = _group_setup(
        q_ptr, bt_ptr, lens_ptr, row_ids_ptr, q_rows_ptr, row, kvh, window, stride_qt,
        stride_qh, stride_br, stride_bh, stride_lr, stride_lh, G, HEAD_DIM, HEAD_PAD, BLOCK_M,
        TILE_N, Q_ROWS,
    )  # fmt: skip
    tile_lo, tile_hi = _split_tiles(tile_lo, tile_hi, s, NUM_SPLITS, MIN_TILES)
    tile_hi = _scored_tiles(scored_ptr, row_ids_ptr, row, tile_lo, tile_hi, ROW_FLAGS)
    g = row.to(tl.int64) * NUM_HEADS + head  # [BLOCK_M]
    m_fin = tl.load(glob_m_ptr + g, mask=row_mask, other=0.0)
    inv_l = tl.where(row_mask, 1.0 / tl.load(glob_l_ptr + g, mask=row_mask, other=1.0), 0.0)
    _score_range(
        q, m_fin, inv_l, scores_ptr, k_cache_ptr, bt_row, stride_bb, tile_lo, tile_hi, key_lo,
        key_hi, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST,
        PRECISION,
    )  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=_INDEX_PTRS)
def _split_score_kernel(
    scores_ptr,  # [num_blocks * block_size] fp32
    scored_ptr,  # [table rows] int32 (read with ROW_FLAGS)
    glob_m_ptr,  # [rows, num_heads] fp32
    glob_l_ptr,
    q_ptr,
    k_cache_ptr,
    bt_ptr,
    lens_ptr,
    row_ids_ptr,
    q_rows_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_br,
    stride_bh,
    stride_bb,
    stride_lr,
    stride_lh,
    stride_cb,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    ROW_FLAGS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    Q_ROWS: tl.constexpr,
    MIN_TILES: tl.constexpr,
):
    """One program per (row, KV head, split): ``_split_score_program``."""
    _split_score_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), scores_ptr, scored_ptr,
        glob_m_ptr, glob_l_ptr, q_ptr, k_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr, q_rows_ptr,
        qk_scale, window, stride_qt, stride_qh, stride_br, stride_bh, stride_bb, stride_lr,
        stride_lh, stride_cb, stride_cs, NUM_HEADS, NUM_SPLITS, G, HEAD_DIM, HEAD_PAD,
        BLOCK_SIZE, BLOCK_M, TILE_N, ROW_FLAGS, UPCAST, PRECISION, Q_ROWS, MIN_TILES,
    )  # fmt: skip


# Long heads split, short heads single-pass (``long_tiles``): KV-Compress leaves a layer's
# heads uneven (Benchmark D at 6,000 / cr 8, H200: p50 880 KVs, p99 4,225, max 6,452), and one
# program per (row, KV head) then waits on its longest head. The grid split (rows x heads x
# splits) pays for every short head's empty splits - a program that only exits still takes a
# slot of an SM sized for its K/V tiles: an 8:16 grid over even heads of 400 KVs took 286 us
# against 104 single-pass; a persistent grid over a list of every head's non-empty splits
# still took 165 (H200, ``kvc_decode_skew.py``). So the single-pass kernel keeps the short
# heads (at most LONG_TILES tiles: output and scores in one program, as before) and, for a
# longer head, runs its split 0 only, writes that partial and lists the head's other non-empty
# splits as items (an atomic counter reserves their places). ``_long_split_kernel``
# (persistent: program p takes items p, p + P, ...) runs them; the last split of a head to
# finish (a per-head atomic count) combines its partials into the output and the softmax's
# max and sum, and ``_long_score_kernel`` (persistent, a second item list) re-reads those
# splits' keys for their scores. With no long head the two exit at once. (Until d4a5b57 the
# lists held heads and every head took S - 1 and S items, empty ones too: a program's set-up
# per item, serial in a persistent program, cost l16:4:8 on even heads 287 us against 73.)


@triton.jit(do_not_specialize_on_alignment=["row_ids_ptr", "q_rows_ptr"])
def _long_split_kernel(
    att_items_ptr,  # [rows * KV heads * S] int32: listed splits, (row * KV heads + kvh) * S + s
    count_ptr,  # [2] int32: how many (count[0])
    done_ptr,  # [rows * KV heads] int32: 1 - n from split 0's program, + 1 per other split
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    glob_m_ptr,
    glob_l_ptr,
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    lens_ptr,
    row_ids_ptr,
    q_rows_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_br,
    stride_bh,
    stride_bb,
    stride_lr,
    stride_lh,
    stride_cb,
    stride_cs,
    stride_ot,
    stride_oh,
    NUM_KV_HEADS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    Q_ROWS: tl.constexpr,
    MIN_TILES: tl.constexpr,
):
    """Persistent: the listed splits (item ``att_items[j]`` = head i * S + split s, s >= 1);
    the head's last split to finish combines it."""
    total = tl.load(count_ptr)
    for j in range(tl.program_id(0), total, tl.num_programs(0)):
        item = tl.load(att_items_ptr + j)
        i = item // NUM_SPLITS
        row = i // NUM_KV_HEADS
        kvh = i % NUM_KV_HEADS
        _split_program(
            row, kvh, item % NUM_SPLITS, part_acc_ptr, part_m_ptr, part_l_ptr, q_ptr,
            k_cache_ptr, v_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr, q_rows_ptr, qk_scale,
            window, stride_qt, stride_qh, stride_br, stride_bh, stride_bb, stride_lr, stride_lh,
            stride_cb, stride_cs, NUM_HEADS, NUM_SPLITS, G, HEAD_DIM, HEAD_PAD, BLOCK_SIZE,
            BLOCK_M, TILE_N, UPCAST, PRECISION, Q_ROWS, MIN_TILES,
        )  # fmt: skip
        tl.debug_barrier()  # every warp's partial stored before the count says so
        if tl.atomic_add(done_ptr + i, 1, sem="acq_rel") == -1:  # the last one
            tl.debug_barrier()
            orow = _out_row(q_rows_ptr, row, Q_ROWS)
            for g in tl.static_range(G):
                h = kvh * G + g
                _combine_head(
                    out_ptr, glob_m_ptr, glob_l_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
                    row.to(tl.int64) * NUM_HEADS + h, orow, h, stride_ot, stride_oh,
                    NUM_SPLITS, SPLIT_PAD, HEAD_DIM, HEAD_PAD, True,
                )  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=_INDEX_PTRS)
def _long_score_kernel(
    score_items_ptr,  # [rows * KV heads * S] int32: listed splits, (row * KV heads + kvh) * S + s
    count_ptr,  # [2] int32: how many (count[1])
    scores_ptr,
    scored_ptr,
    glob_m_ptr,
    glob_l_ptr,
    q_ptr,
    k_cache_ptr,
    bt_ptr,
    lens_ptr,
    row_ids_ptr,
    q_rows_ptr,
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_br,
    stride_bh,
    stride_bb,
    stride_lr,
    stride_lh,
    stride_cb,
    stride_cs,
    NUM_KV_HEADS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    ROW_FLAGS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    Q_ROWS: tl.constexpr,
    MIN_TILES: tl.constexpr,
):
    """Persistent: the scores of the listed splits' keys (item ``score_items[j]`` = head
    i * S + split s) from their heads' combined max and sum."""
    total = tl.load(count_ptr + 1)
    for j in range(tl.program_id(0), total, tl.num_programs(0)):
        item = tl.load(score_items_ptr + j)
        i = item // NUM_SPLITS
        _split_score_program(
            i // NUM_KV_HEADS, i % NUM_KV_HEADS, item % NUM_SPLITS, scores_ptr, scored_ptr,
            glob_m_ptr, glob_l_ptr, q_ptr, k_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr,
            q_rows_ptr, qk_scale, window, stride_qt, stride_qh, stride_br, stride_bh, stride_bb,
            stride_lr, stride_lh, stride_cb, stride_cs, NUM_HEADS, NUM_SPLITS, G, HEAD_DIM,
            HEAD_PAD, BLOCK_SIZE, BLOCK_M, TILE_N, ROW_FLAGS, UPCAST, PRECISION, Q_ROWS,
            MIN_TILES,
        )  # fmt: skip
