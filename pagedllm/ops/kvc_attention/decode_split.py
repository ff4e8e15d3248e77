"""Split-K decode over KV-Compress's per-head paged cache: the split, combine and score
kernels (``num_splits`` > 1), and the persistent kernels that finish the long heads of a
single pass (``long_tiles``). :func:`.decode.kvc_decode_attention` launches them.

Every kernel here takes its own buffers, then the decode group's arguments in
:class:`.common.DecodeInputs`' order (the score kernels without V), then its constexprs.

Long heads split, short heads whole (``long_tiles``): KV-Compress leaves a layer's heads
uneven, and one program per (row, KV head) would wait on its longest head, while a grid of rows
x heads x splits pays for every short head's empty splits (a program that only exits still
takes an SM slot sized for its K/V tiles). So the single-pass kernel keeps the short heads (at
most LONG_TILES tiles: output and scores in one program) and, for a longer head, runs its split
0 only, writes that partial and lists the head's other non-empty splits as items (an atomic
counter reserves their places). :func:`_long_split_kernel` (persistent: program p takes items
p, p + P, ...) runs them; the last split of a head to finish (a per-head atomic count) combines
its partials into the output and the softmax's max and sum, and :func:`_long_score_kernel`
(persistent, a second item list) re-reads those splits' keys for their scores. Only non-empty
splits are listed: a persistent program pays each item's set-up in turn. With no long head the
two exit at once. Benchmark D (``benchmarks/kvcompress_throughput.py``) measures the path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.ops.kvc_attention.common import (
    _INDEX_PTRS,
    DecodeInputs,
    Partials,
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
    row, kvh, s, part, inp, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, G: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    Q_ROWS: tl.constexpr, MIN_TILES: tl.constexpr,
):  # fmt: skip
    """Split ``s`` of (row, KV head) (``inp``: :class:`DecodeInputs`): its partial (acc, max,
    sum) per query head in ``part`` (:class:`Partials`); an empty split writes (-inf, 0) and
    no acc (the combine does not read it)."""
    q, row_mask, head, keys, tile_lo, tile_hi, qrow = _group_setup(
        inp, row, kvh, G, HEAD_DIM, HEAD_PAD, BLOCK_M, TILE_N, Q_ROWS
    )
    tile_lo, tile_hi = _split_tiles(tile_lo, tile_hi, s, NUM_SPLITS, MIN_TILES)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, keys, tile_lo, tile_hi, inp.qk_scale, HEAD_DIM, HEAD_PAD, BLOCK_SIZE,
        TILE_N, UPCAST, PRECISION,
    )  # fmt: skip
    # Example: NUM_HEADS 8, NUM_SPLITS 4, row 2, head 5, split 3 -> part row (2 * 8 + 5) * 4 + 3.
    prow = (row.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + s  # [BLOCK_M]
    busy = row_mask & (tile_lo < tile_hi)
    _store_partial(part, prow, acc, m_i, l_i, row_mask, busy, HEAD_PAD)


@triton.jit(do_not_specialize_on_alignment=["row_ids_ptr", "q_rows_ptr"])
def _split_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr,  # Partials
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr, q_rows_ptr, qk_scale, window,
    stride_qt, stride_qh, stride_br, stride_bh, stride_bb, stride_lr, stride_lh, stride_cb,
    stride_cs,  # DecodeInputs
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, Q_ROWS: tl.constexpr,
    MIN_TILES: tl.constexpr,
):  # fmt: skip
    """One program per (row, KV head, split): :func:`_split_program`."""
    inp = DecodeInputs(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr,
                       q_rows_ptr, qk_scale, window, stride_qt, stride_qh, stride_br, stride_bh,
                       stride_bb, stride_lr, stride_lh, stride_cb, stride_cs)  # fmt: skip
    _split_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2),
        Partials(part_acc_ptr, part_m_ptr, part_l_ptr), inp, NUM_HEADS, NUM_SPLITS, G,
        HEAD_DIM, HEAD_PAD, BLOCK_SIZE, BLOCK_M, TILE_N, UPCAST, PRECISION, Q_ROWS, MIN_TILES,
    )  # fmt: skip


@triton.jit
def _combine_head(
    out_ptr,
    glob_m_ptr,
    glob_l_ptr,
    part,  # Partials
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
    l_s = tl.load(part.l_ptr + prow, mask=sp_mask, other=0.0)
    m_s = tl.load(part.m_ptr + prow, mask=sp_mask, other=float("-inf"))
    m_all = tl.max(m_s, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m_s - m_all)  # empty splits (m -inf) weigh 0
    denom = tl.sum(w * l_s, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    d = tl.arange(0, HEAD_PAD)
    d_mask = d < HEAD_DIM
    busy = sp_mask & (m_s != float("-inf"))  # an empty split wrote no acc (weight 0)
    acc = tl.load(  # [SPLIT_PAD, HEAD_PAD]
        part.acc_ptr + prow[:, None] * HEAD_PAD + d[None, :],
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
    """One program per (row, query head): :func:`_combine_head`, written to output row
    ``q_rows[row]`` (Q_ROWS) or ``row``."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    orow = _out_row(q_rows_ptr, row, Q_ROWS)
    _combine_head(
        out_ptr, glob_m_ptr, glob_l_ptr, Partials(part_acc_ptr, part_m_ptr, part_l_ptr),
        row.to(tl.int64) * NUM_HEADS + h, orow, h, stride_ot, stride_oh, NUM_SPLITS, SPLIT_PAD,
        HEAD_DIM, HEAD_PAD, STORE_ML,
    )  # fmt: skip


@triton.jit
def _split_score_program(
    row, kvh, s, scores_ptr, scored_ptr, glob_m_ptr, glob_l_ptr, inp, NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    ROW_FLAGS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    Q_ROWS: tl.constexpr, MIN_TILES: tl.constexpr,
):  # fmt: skip
    """Split ``s`` of (row, KV head): its keys' scores from the combined max and sum (the
    same tiles as the split's :func:`_split_program`)."""
    q, row_mask, head, keys, tile_lo, tile_hi, qrow = _group_setup(
        inp, row, kvh, G, HEAD_DIM, HEAD_PAD, BLOCK_M, TILE_N, Q_ROWS
    )
    tile_lo, tile_hi = _split_tiles(tile_lo, tile_hi, s, NUM_SPLITS, MIN_TILES)
    tile_hi = _scored_tiles(scored_ptr, inp.row_ids_ptr, row, tile_lo, tile_hi, ROW_FLAGS)
    g = row.to(tl.int64) * NUM_HEADS + head  # [BLOCK_M]
    m_fin = tl.load(glob_m_ptr + g, mask=row_mask, other=0.0)
    inv_l = tl.where(row_mask, 1.0 / tl.load(glob_l_ptr + g, mask=row_mask, other=1.0), 0.0)
    _score_range(q, m_fin, inv_l, scores_ptr, keys, tile_lo, tile_hi, inp.qk_scale, HEAD_DIM,
                 HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST, PRECISION)  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=_INDEX_PTRS)
def _split_score_kernel(
    scores_ptr,  # [num_blocks * block_size] fp32
    scored_ptr,  # [table rows] int32 (read with ROW_FLAGS)
    glob_m_ptr,  # [rows, num_heads] fp32
    glob_l_ptr,
    q_ptr, k_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr, q_rows_ptr, qk_scale, window, stride_qt,
    stride_qh, stride_br, stride_bh, stride_bb, stride_lr, stride_lh, stride_cb,
    stride_cs,  # DecodeInputs without V
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr, ROW_FLAGS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, Q_ROWS: tl.constexpr, MIN_TILES: tl.constexpr,
):  # fmt: skip
    """One program per (row, KV head, split): :func:`_split_score_program`."""
    inp = DecodeInputs(q_ptr, k_cache_ptr, k_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr,
                       q_rows_ptr, qk_scale, window, stride_qt, stride_qh, stride_br, stride_bh,
                       stride_bb, stride_lr, stride_lh, stride_cb, stride_cs)  # fmt: skip
    _split_score_program(
        tl.program_id(0), tl.program_id(1), tl.program_id(2), scores_ptr, scored_ptr,
        glob_m_ptr, glob_l_ptr, inp, NUM_HEADS, NUM_SPLITS, G, HEAD_DIM, HEAD_PAD, BLOCK_SIZE,
        BLOCK_M, TILE_N, ROW_FLAGS, UPCAST, PRECISION, Q_ROWS, MIN_TILES,
    )  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=["row_ids_ptr", "q_rows_ptr"])
def _long_split_kernel(
    att_items_ptr,  # [rows * KV heads * S] int32: listed splits, (row * KV heads + kvh) * S + s
    count_ptr,  # [2] int32: how many (count[0])
    done_ptr,  # [rows * KV heads] int32: 1 - n from split 0's program, + 1 per other split
    part_acc_ptr, part_m_ptr, part_l_ptr,  # Partials
    glob_m_ptr,
    glob_l_ptr,
    out_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr, q_rows_ptr, qk_scale, window,
    stride_qt, stride_qh, stride_br, stride_bh, stride_bb, stride_lr, stride_lh, stride_cb,
    stride_cs,  # DecodeInputs
    stride_ot,
    stride_oh,
    NUM_KV_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLIT_PAD: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, Q_ROWS: tl.constexpr,
    MIN_TILES: tl.constexpr,
):  # fmt: skip
    """Persistent: the listed splits (item ``att_items[j]`` = head i * S + split s, s >= 1);
    the head's last split to finish combines it."""
    inp = DecodeInputs(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr,
                       q_rows_ptr, qk_scale, window, stride_qt, stride_qh, stride_br, stride_bh,
                       stride_bb, stride_lr, stride_lh, stride_cb, stride_cs)  # fmt: skip
    part = Partials(part_acc_ptr, part_m_ptr, part_l_ptr)
    total = tl.load(count_ptr)
    for j in range(tl.program_id(0), total, tl.num_programs(0)):
        item = tl.load(att_items_ptr + j)
        i = item // NUM_SPLITS
        row = i // NUM_KV_HEADS
        kvh = i % NUM_KV_HEADS
        _split_program(row, kvh, item % NUM_SPLITS, part, inp, NUM_HEADS, NUM_SPLITS, G,
                       HEAD_DIM, HEAD_PAD, BLOCK_SIZE, BLOCK_M, TILE_N, UPCAST, PRECISION, Q_ROWS,
                       MIN_TILES)  # fmt: skip
        tl.debug_barrier()  # every warp's partial stored before the count says so
        if tl.atomic_add(done_ptr + i, 1, sem="acq_rel") == -1:  # the last one
            tl.debug_barrier()
            orow = _out_row(q_rows_ptr, row, Q_ROWS)
            for g in tl.static_range(G):
                h = kvh * G + g
                _combine_head(out_ptr, glob_m_ptr, glob_l_ptr, part,
                              row.to(tl.int64) * NUM_HEADS + h, orow, h, stride_ot, stride_oh,
                              NUM_SPLITS, SPLIT_PAD, HEAD_DIM, HEAD_PAD, True)  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=_INDEX_PTRS)
def _long_score_kernel(
    score_items_ptr,  # [rows * KV heads * S] int32: listed splits, (row * KV heads + kvh) * S + s
    count_ptr,  # [2] int32: how many (count[1])
    scores_ptr,
    scored_ptr,
    glob_m_ptr,
    glob_l_ptr,
    q_ptr, k_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr, q_rows_ptr, qk_scale, window, stride_qt,
    stride_qh, stride_br, stride_bh, stride_bb, stride_lr, stride_lh, stride_cb,
    stride_cs,  # DecodeInputs without V
    NUM_KV_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, ROW_FLAGS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, Q_ROWS: tl.constexpr, MIN_TILES: tl.constexpr,
):  # fmt: skip
    """Persistent: the scores of the listed splits' keys (item ``score_items[j]`` = head
    i * S + split s) from their heads' combined max and sum."""
    inp = DecodeInputs(q_ptr, k_cache_ptr, k_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr,
                       q_rows_ptr, qk_scale, window, stride_qt, stride_qh, stride_br, stride_bh,
                       stride_bb, stride_lr, stride_lh, stride_cb, stride_cs)  # fmt: skip
    total = tl.load(count_ptr + 1)
    for j in range(tl.program_id(0), total, tl.num_programs(0)):
        item = tl.load(score_items_ptr + j)
        i = item // NUM_SPLITS
        _split_score_program(
            i // NUM_KV_HEADS, i % NUM_KV_HEADS, item % NUM_SPLITS, scores_ptr, scored_ptr,
            glob_m_ptr, glob_l_ptr, inp, NUM_HEADS, NUM_SPLITS, G, HEAD_DIM, HEAD_PAD,
            BLOCK_SIZE, BLOCK_M, TILE_N, ROW_FLAGS, UPCAST, PRECISION, Q_ROWS, MIN_TILES,
        )  # fmt: skip
