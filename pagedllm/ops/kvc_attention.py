"""Triton attention over KV-Compress's per-head paged cache, scoring the keys on the way.

Layout (``pagedllm.kvcompress.cache``): one block holds ``block_size`` consecutive keys of ONE KV
head of ONE layer. Inputs (all on one device):

- ``kv_cache`` [2, num_blocks, block_size, head_dim] (0 = K, 1 = V); slot
  ``s = block_id * block_size + offset``.
- ``block_tables`` [rows, num_kv_heads, max_blocks] int32 and ``seq_lens`` [rows, num_kv_heads]
  (int32 or int64; either may be a strided view): every (row, KV head) has its own table and
  length. Its keys are at logical indices ``0..len-1``; logical index ``i`` sits in block
  ``block_tables[row, head, i // block_size]`` at offset ``i % block_size``.

  Example: block_size 4, block_tables[2, 1] = [7, 3, 9], seq_lens[2, 1] = 10 -> logical
  indices 0-3 are slots 28-31 (block 7), 4-7 slots 12-15 (block 3), 8-9 slots 36-37 (block 9);
  with sliding_window 3 the decode query of that head sees logical 7, 8, 9 = slots 15, 36, 37.
- GQA: query head ``q`` reads KV head ``q // G``, ``G = num_heads // num_kv_heads``.

Decode (:func:`kvc_decode_attention`, one query token per row, the token's own key already the
head's last): one program per (row, KV head) serves the G query heads of the group, so every
K/V tile is read once per group. Online softmax over tiles of ``TILE_N`` logical indices;
tiles that lie wholly inside ``[len - window, len)`` skip the masks. With ``scores`` a second
pass over the same keys, once the softmax's max and sum are final, recomputes q.k and adds
``sum over the group of p^2`` to each key's slot (each slot belongs to one (row, head), so a
plain load/add/store suffices). Long contexts at small batch: split-K (the count from
:func:`kvc_decode_num_splits` unless given), ``num_splits`` programs per (row, KV head) over
equal slices of the head's tiles writing partial (acc, max, sum), a combine kernel per (row,
query head), then (with scores) a score pass per split that uses the combined max and sum. The
slice length is computed in the kernel from ``seq_lens``, at least ``min_split_tiles`` tiles.
Uneven heads at a batch that fills the SMs (``SKEW_SPLITS``, on by default for scored rows):
the single pass keeps the short heads and splits only the long ones (``long_tiles``).

Measured on an H200 (bf16, head_dim 128, G 4, 8 KV heads, CUDA-graph time; paged_attention
on the same bytes in brackets): 128 x 1k keys 136 us (129), 1 x 32k 44 us (42), 8 x 8k 76 us
(71); the scores pass adds about 80% (it reads K again).

Prefill chunks (:func:`kvc_paged_attention`): one program per (query tile of a chunk, KV head),
the unified paged kernel's loop over key tiles (:mod:`pagedllm.ops.paged_attention`) on that
head's own table and length; query and output rows, table rows and lengths are read in place
through the step's index tensors (no per-layer gather or permutation); no scores.

Host-side dispatch uses shapes only (no device-to-host sync). This module imports Triton at
import time; under ``TRITON_INTERPRET=1`` the kernels also run on CPU tensors, for tests.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedllm.ops.paged_attention import (
    TileConfig,
    _find_request,
    _num_sms,
    _query_tile,
    _store_tile,
    default_tile_config,
)
from pagedllm.ops.paged_attention import _attend_range as _paged_attend_range

__all__ = [
    "kvc_decode_attention",
    "kvc_decode_auto_splits",
    "kvc_decode_num_splits",
    "kvc_paged_attention",
    "kvc_window_scores",
]

LOG2E = 1.4426950408889634

# The single-pass decode kernel's launch shape when set (benchmarks compare shapes inside the
# engine with it: ``benchmarks/gpu_suite.py --kvc-tiles``); None: kvc_decode_tile_config's.
DECODE_TILE_OVERRIDE: TileConfig | None = None


def _skew_splits_from_env() -> tuple[int, int, int] | None:
    """``PAGEDLLM_KVC_SKEW_SPLITS``: "S:M" or "S:M:T" (split count, least tiles a split, the
    tiles past which a head is split; T defaults to M); "0": none; unset: 8:8:16."""
    text = os.environ.get("PAGEDLLM_KVC_SKEW_SPLITS", "8:8:16")
    if text.strip() in ("", "0"):
        return None
    parts = [int(x) for x in text.split(":")]
    if len(parts) == 2:
        parts.append(parts[1])
    if len(parts) != 3 or parts[0] < 2 or parts[1] < 1 or parts[2] < 1:
        raise ValueError(
            f"PAGEDLLM_KVC_SKEW_SPLITS must be S:M[:T] with S >= 2, M, T >= 1: {text!r}"
        )
    return parts[0], parts[1], parts[2]


# Scored decode rows at a batch that fills the SMs (one program per (row, KV head), no split)
# split their heads longer than T key tiles into up to S splits of at least M tiles each
# (``long_tiles``: the single pass keeps the others). KV-Compress's evictions leave a layer's
# heads uneven - a few keep a whole prompt - and the single pass then waits on its longest
# head. H200, tree 8d5fed9 (``results/kvc_decode_skew_NVIDIA_H200_8d5fed9.json``; one layer of
# the 8B shape, score pass on): 108 rows of mean 200 with 2% whole-prompt heads 342 -> 143 us,
# 30 rows of mean 900 307 -> 205, even heads 61 -> 66 and 73 -> 78 us (two more launches);
# Benchmark D at 6,000 decode steps 9.8 -> 8.7 ms (cr 64) and 10.6 -> 10.2 (cr 8), at 2,000 /
# cr 64 (no head past 16 tiles) 7.47 -> 7.61 ms at the same tok/s. The grid split before it
# (every head's S programs; tree 118cb3b, 1df604f) lost: 8:16 10.8 ms against 9.5 at cr 64,
# its short heads' empty programs taking SM slots. "0" in the env variable turns it off.
# Tree 4505b2e (only non-empty splits listed; ``..._4505b2e.json``), tail-2 cases 30 x 900 /
# 108 x 200 / 128 x 400: 8:16:16 140 / 144 / 193 us, 8:8:16 133 / 130 / 183 (the default
# since), 16:4:16 145 / 125 / 180, a threshold of 8 tiles or less slower on even heads at 30
# rows (126-177 us against 78); Benchmark D 6,000 / cr 8 decode steps 8.76 ms with 8:16:16,
# 8.61 with 8:8:16 (10.05 before the item lists). Tried and removed: a short head's scores
# deferred to the long-split kernel past D tiles (73dd797; 9f010c3's micro: 30 x 900 tail-2
# 132 -> 130 us, even heads 78 -> 94).
SKEW_SPLITS: tuple[int, int, int] | None = _skew_splits_from_env()

# ``long_tiles``: the persistent kernels' programs per SM (long heads' splits and scores).
LONG_PROGRAMS_PER_SM = 2


# --------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


# The step's index tensors (table rows, query rows) are views at any offset of one shipped
# buffer: no specialization on their alignment, or a mixed step's decode rows would meet new
# kernel variants (a Triton compile each, seconds) long after the warm-up.
_INDEX_PTRS = ["row_ids_ptr", "q_rows_ptr", "scored_ptr"]


@triton.jit
def _finish_head(
    out_ptr, scores_ptr, scored_ptr, row_ids_ptr, row, q, qrow, head, row_mask, acc, l_i, m_i,
    k_cache_ptr, bt_row, stride_bb, tile_lo, tile_hi, key_lo, key_hi, qk_scale, stride_ot,
    stride_oh, stride_cb, stride_cs, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SCORES: tl.constexpr,
    ROW_FLAGS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """A head one program attended whole: its output, then (SCORES) its keys' scores."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a head with no key: acc 0 -> output 0
    d = tl.arange(0, HEAD_PAD)
    tl.store(
        out_ptr + qrow * stride_ot + head[:, None] * stride_oh + d[None, :],
        (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & (d < HEAD_DIM)[None, :],
    )
    if SCORES:
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        inv_l = tl.where(row_mask, 1.0 / l_safe, 0.0)
        tile_hi = _scored_tiles(scored_ptr, row_ids_ptr, row, tile_lo, tile_hi, ROW_FLAGS)
        _score_range(
            q, m_fin, inv_l, scores_ptr, k_cache_ptr, bt_row, stride_bb, tile_lo, tile_hi,
            key_lo, key_hi, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE,
            TILE_N, UPCAST, PRECISION,
        )  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=_INDEX_PTRS)
def _decode_kernel(
    out_ptr,  # [rows, num_heads, head_dim]
    q_ptr,  # [rows, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, head_dim]
    v_cache_ptr,
    bt_ptr,  # [rows, num_kv_heads, max_blocks] int32
    lens_ptr,  # [rows, num_kv_heads] int32/int64
    row_ids_ptr,  # [rows] int64
    q_rows_ptr,  # [rows] int64: query/output row of each row (read with Q_ROWS)
    scores_ptr,  # [num_blocks * block_size] fp32 (unused without SCORES)
    scored_ptr,  # [table rows] int32: 0 = the row's keys are not scored (read with ROW_FLAGS)
    qk_scale,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_br,
    stride_bh,
    stride_bb,
    stride_lr,
    stride_lh,
    stride_cb,
    stride_cs,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SCORES: tl.constexpr,
    ROW_FLAGS: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    Q_ROWS: tl.constexpr,
    # LONG_SPLITS > 0: a head longer than LONG_TILES tiles gets only its split 0 here (of
    # its n non-empty splits, at most LONG_SPLITS of at least MIN_TILES tiles each:
    # ``_split_tiles``): that partial, (-inf, 0) for its empty splits, 1 - n in ``done``, its
    # splits 1..n-1 listed in ``att_items`` and (SCORES, a scored row) 0..n-1 in ``score_items``
    part_acc_ptr=None,  # [rows, num_heads, LONG_SPLITS, HEAD_PAD] fp32
    part_m_ptr=None,  # [rows, num_heads, LONG_SPLITS] fp32
    part_l_ptr=None,
    att_items_ptr=None,  # [rows * num_kv_heads * LONG_SPLITS] int32: (row * kv heads + kvh) * S + s
    score_items_ptr=None,  # [rows * num_kv_heads * LONG_SPLITS] int32: the same encoding
    count_ptr=None,  # [2] int32, 0 before the launch: items listed in each
    done_ptr=None,  # [rows * num_kv_heads] int32
    NUM_KV_HEADS: tl.constexpr = 1,
    NUM_HEADS: tl.constexpr = 1,
    LONG_SPLITS: tl.constexpr = 0,
    SPLIT_PAD: tl.constexpr = 1,
    MIN_TILES: tl.constexpr = 1,
    LONG_TILES: tl.constexpr = 1,
):
    """One program per (row, KV head): the G query heads' output and (SCORES) the keys'
    scores (with ROW_FLAGS only for table rows whose ``scored`` flag is set); with
    LONG_SPLITS, a long head's split 0 (see ``_long_split_kernel``)."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    q, row_mask, head, bt_row, key_lo, key_hi, tile_lo, tile_hi, qrow = _group_setup(
        q_ptr, bt_ptr, lens_ptr, row_ids_ptr, q_rows_ptr, row, kvh, window, stride_qt,
        stride_qh, stride_br, stride_bh, stride_lr, stride_lh, G, HEAD_DIM, HEAD_PAD, BLOCK_M,
        TILE_N, Q_ROWS,
    )  # fmt: skip
    if LONG_SPLITS > 0:  # a long head's split 0; all the tiles of a short one
        split0_hi = _split_tiles(tile_lo, tile_hi, 0, LONG_SPLITS, MIN_TILES)[1]
        att_hi = tl.where(tile_hi - tile_lo <= LONG_TILES, tile_hi, split0_hi)
    else:
        att_hi = tile_hi
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, stride_bb, tile_lo, att_hi, key_lo,
        key_hi, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST,
        PRECISION,
    )  # fmt: skip
    if LONG_SPLITS > 0:
        if att_hi == tile_hi:
            _finish_head(
                out_ptr, scores_ptr, scored_ptr, row_ids_ptr, row, q, qrow, head, row_mask, acc,
                l_i, m_i, k_cache_ptr, bt_row, stride_bb, tile_lo, tile_hi, key_lo, key_hi,
                qk_scale, stride_ot, stride_oh, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD,
                BLOCK_SIZE, TILE_N, SCORES, ROW_FLAGS, UPCAST, PRECISION,
            )  # fmt: skip
        else:
            # Example: NUM_HEADS 32, LONG_SPLITS 8, row 2, head 5 -> part row (2 * 32 + 5) * 8.
            prow = (row.to(tl.int64) * NUM_HEADS + head) * LONG_SPLITS
            _store_partial(part_acc_ptr, part_m_ptr, part_l_ptr, prow, acc, m_i, l_i, row_mask,
                           row_mask, HEAD_PAD)  # fmt: skip
            # Only the non-empty splits become items (an empty one would still cost a
            # persistent program its set-up); the combine weighs the empty ones' (-inf, 0) 0.
            # Example: S 8, M 4, 18 tiles -> per 4, n 5: items s = 1..4, partials 5-7 empty.
            n = _used_splits(tile_lo, tile_hi, LONG_SPLITS, MIN_TILES)
            sp = tl.arange(0, SPLIT_PAD)
            empty = row_mask[:, None] & ((sp >= n) & (sp < LONG_SPLITS))[None, :]
            eptr = prow[:, None] + sp[None, :]  # [BLOCK_M, SPLIT_PAD]
            tl.store(part_m_ptr + eptr, tl.full([BLOCK_M, SPLIT_PAD], float("-inf"), tl.float32),
                     mask=empty)  # fmt: skip
            tl.store(part_l_ptr + eptr, tl.zeros([BLOCK_M, SPLIT_PAD], tl.float32), mask=empty)
            i = row * NUM_KV_HEADS + kvh
            tl.store(done_ptr + i, 1 - n)  # the last of the n - 1 other splits sees -1
            at = tl.atomic_add(count_ptr, n - 1)
            tl.store(att_items_ptr + at + sp - 1, i * LONG_SPLITS + sp, mask=(sp >= 1) & (sp < n))
            if SCORES:
                sc_hi = _scored_tiles(scored_ptr, row_ids_ptr, row, tile_lo, tile_hi, ROW_FLAGS)
                n_sc = tl.where(sc_hi > tile_lo, n, 0)
                at = tl.atomic_add(count_ptr + 1, n_sc)
                tl.store(score_items_ptr + at + sp, i * LONG_SPLITS + sp, mask=sp < n_sc)
    else:
        _finish_head(
            out_ptr, scores_ptr, scored_ptr, row_ids_ptr, row, q, qrow, head, row_mask, acc, l_i,
            m_i, k_cache_ptr, bt_row, stride_bb, tile_lo, tile_hi, key_lo, key_hi, qk_scale,
            stride_ot, stride_oh, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N,
            SCORES, ROW_FLAGS, UPCAST, PRECISION,
        )  # fmt: skip


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


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def kvc_decode_tile_config(
    head_pad: int, scores: bool, device: torch.device, elem_bytes: int
) -> TileConfig:
    """Launch shape of the single-pass decode kernel: without the score pass, 128-key tiles
    and 3 stages where the device's shared memory holds 3 stages of K and V tiles (Hopper, 16-
    bit caches up to head size 128: 192 KB of 227); otherwise the unified kernel's decode
    default, 64-key tiles and 2 stages (32-key tiles at head size 256). The split path keeps
    that default too, which it was measured with.

    Measured on an H200 (``benchmarks/attn_decode_sweep.py --narrow``, bf16, 256 rows, head
    size 128; layout ``kvc`` without scores, ``kvcs`` with the score pass built in and every
    row's flag 0, as the engine's never-evicting requests run it). Benchmark A's decode batch
    (100-2,048 keys, 16 / 8 heads): without scores 0.297 ms (92.7% of the copy bandwidth)
    with 128 / 3 against 0.312 ms with 64 / 2, and 0.306 ms for the unified kernel on the same
    keys; with the score pass built in 64 / 2 is best (0.311 ms), 128 / 3 0.315. Benchmark B's
    (128-1,152 keys, 32 / 8 heads): without scores 0.187 vs 0.196 ms (unified 0.194); with
    them 0.196 (64 / 2) vs 0.209 (128 / 3). Inside the engine (Benchmark A, one call) the
    scored kernel took 2.6% more decode time with 128 / 3 than with 64 / 2.
    """
    wide = TileConfig(block_m=16, tile_n=128, num_warps=4, num_stages=3)
    need = wide.num_stages * 2 * wide.tile_n * head_pad * elem_bytes  # K and V tiles
    if head_pad <= 128 and not scores and need <= _max_shared_memory(device):
        return wide
    return default_tile_config(head_pad, decode=True)


@functools.cache
def _max_shared_memory(device: torch.device) -> int:
    """Shared memory one program may use on ``device``, in bytes, as Triton's driver reports
    it (0 when it cannot say; no bound on the CPU interpreter)."""
    if device.type != "cuda":
        return 1 << 30
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        return int(props["max_shared_mem"])
    except Exception:  # an older or other driver: the default launch shape
        return 0


def kvc_decode_num_splits(
    num_rows: int, num_kv_heads: int, max_len: int, device: torch.device, tile_n: int = 64
) -> int:
    """Split count of the decode path (1 = the single-pass kernel), from host ints only.

    The shape of paged_attention's rule (:func:`pagedllm.ops.paged_attention.choose_num_splits`)
    with one program per (row, KV head), and constants measured for this kernel: split only
    when the programs do not fill the SMs (rows x KV heads < SMs), into the largest power of
    two that keeps programs x splits <= 2 per SM, at most 64 and at most the tiles of
    ``max_len`` keys. ``max_len`` bounds the heads' lengths on the host (the decode entry point
    passes the block tables' capacity, ``max_blocks * block_size``, or the window if smaller).
    Example (H200, 132 SMs, 8 KV heads): 1 row -> 8 programs -> 32 splits at 32k keys; 8 rows
    -> 4; 32 rows (256 programs) -> 1. Measured there (bf16, head_dim 128, G 4, CUDA-graph
    time): 1 x 32k 43.7 us with 32 splits (51.7 with paged_attention's 64), 8 x 8k 75.7 us
    with 4 (89.0 with its 8), 32 x 4k 138.8 us unsplit (169.8 with its 2).
    """
    programs = num_rows * num_kv_heads
    sms = _num_sms(device)
    if programs >= sms:
        return 1
    want = max(1, (2 * sms) // programs)
    tiles = max(1, triton.cdiv(max_len, tile_n))
    splits = min(64, want, tiles)
    return 1 << (splits.bit_length() - 1)  # round down to a power of two


def kvc_decode_auto_splits(
    num_rows: int,
    block_tables: torch.Tensor,  # [rows, num_kv_heads, max_blocks]
    block_size: int,
    window: int,  # 0 = no sliding window
    head_dim: int,
    device: torch.device,
    tile_n: int | None = None,  # the split path's key tile (default: its default shape's)
) -> int:
    """The split count :func:`kvc_decode_attention` picks for ``num_rows`` rows when not
    given one: :func:`kvc_decode_num_splits` over the tables' capacity (``max_blocks *
    block_size`` keys, or the window if smaller)."""
    max_len = block_tables.shape[2] * block_size
    if window:
        max_len = min(max_len, window)
    if tile_n is None:
        tile_n = default_tile_config(max(16, triton.next_power_of_2(head_dim)), True).tile_n
    return kvc_decode_num_splits(num_rows, block_tables.shape[1], max_len, device, tile_n)


def kvc_decode_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, head_dim]
    block_tables: torch.Tensor,  # [num_rows, num_kv_heads, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_rows, num_kv_heads] int32/int64
    scale: float,
    scores: torch.Tensor | None = None,  # [num_blocks * block_size] float32, updated in place
    sliding_window: int | None = None,
    num_splits: int | None = None,  # None: automatic; 1: single pass; > 1: split-K
    tile_config: TileConfig | None = None,  # override the launch shape (tuning, tests)
    row_ids: torch.Tensor | None = None,  # [num_rows] int64: table rows (None: 0..num_rows-1)
    scored: torch.Tensor | None = None,  # [table rows] int32: score only rows flagged != 0
    q_rows: torch.Tensor | None = None,  # [num_rows] int64: query/output rows (None: 0..)
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]: written in place
    min_split_tiles: int = 1,  # with num_splits > 1: the least key tiles of a split
    long_tiles: int = 0,  # > 0, with num_splits > 1: split only heads longer than this (tiles)
) -> torch.Tensor:
    """Decode attention over per-head paged KVs; returns [num_tokens, num_heads, head_dim] in
    the query's dtype.

    Row r's query head q attends to the keys of KV head ``q // G`` of table row
    ``t = row_ids[r]`` (``r`` without ``row_ids``): logical indices ``[max(len - W, 0), len)``
    with ``len = seq_lens[t, q // G]`` (``W`` = ``sliding_window``, no lower bound without
    one). A head with no key gives 0. With ``scores``, each attended key's slot gets
    ``+= sum over its G query heads of p^2`` (p: the final softmax probability), for every
    row or, with ``scored``, for the table rows whose flag is set (a request that can never
    be evicted skips the score pass).

    Row r's query is ``query[q_rows[r]]`` and its output goes to ``out[q_rows[r]]`` (row r
    without ``q_rows``): the decode rows of a mixed step are read and written in place, no
    gather of the query nor scatter of the output. Output rows no row writes stay as they
    were in ``out``, or come back 0 when ``out`` is None.

    ``row_ids`` lets the caller pass the whole persistent tables and lengths (every request
    row of the cache, no per-step gather): a CUDA graph captures their addresses once.
    Example: tables [8, H, W] of 8 request rows, a step of tokens [prefill a, prefill a,
    decode, decode] whose decodes are table rows 5 and 2 -> ``row_ids = [5, 2]``,
    ``q_rows = [2, 3]``.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = seq_lens.shape[1]
    if row_ids is None:
        num_rows = seq_lens.shape[0]
        row_ids = torch.arange(num_rows, device=query.device)
    else:
        num_rows = row_ids.shape[0]
    assert q_rows is None or q_rows.shape == (num_rows,)
    assert kv_cache.dim() == 4 and kv_cache.shape[0] == 2 and kv_cache.shape[3] == head_dim
    assert block_tables.dim() == 3 and block_tables.shape[:2] == seq_lens.shape
    assert num_heads % num_kv_heads == 0 and num_tokens >= num_rows
    g = num_heads // num_kv_heads
    block_size = kv_cache.shape[2]
    if out is None:
        if q_rows is not None:
            out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
        else:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
            if num_tokens > num_rows:
                out[num_rows:].zero_()
    assert out.shape == query.shape and out.stride(2) == 1
    if num_rows == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.stride(2) == 1 and k_cache.stride() == v_cache.stride()
    if scores is not None:
        assert scores.dtype == torch.float32 and scores.is_contiguous()
        assert scores.numel() >= kv_cache.shape[1] * block_size
    window = int(sliding_window) if sliding_window else 0
    qk_scale = float(scale) * LOG2E
    head_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 on a GPU
    upcast = query.device.type == "cpu"  # the CPU interpreter mis-computes 16-bit dots
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    # the split count from the split path's launch shape (the one it was measured with)
    cfg = tile_config or default_tile_config(head_pad, decode=True)
    block_m = max(16, triton.next_power_of_2(g))
    if num_splits is None:
        num_splits = kvc_decode_auto_splits(
            num_rows, block_tables, block_size, window, head_dim, query.device, cfg.tile_n
        )
        if num_splits == 1 and scores is not None and SKEW_SPLITS is not None:
            s, m, t = SKEW_SPLITS  # (a head longer than T tiles can exist: split the long ones)
            capacity = block_tables.shape[2] * block_size
            if min(capacity, window or capacity) > t * cfg.tile_n:
                num_splits, min_split_tiles, long_tiles = s, m, t
    assert num_splits >= 1 and min_split_tiles >= 1 and long_tiles >= 0
    assert not long_tiles or num_splits > 1, "long_tiles needs num_splits > 1"
    if tile_config is None and num_splits == 1:
        cfg = DECODE_TILE_OVERRIDE or kvc_decode_tile_config(
            head_pad, scores is not None, query.device, kv_cache.element_size()
        )
    tile_n = cfg.tile_n
    strides = (
        query.stride(0), query.stride(1), *block_tables.stride(), *seq_lens.stride(),
        k_cache.stride(0), k_cache.stride(1),
    )  # fmt: skip
    consts = dict(
        G=g, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        TILE_N=tile_n, UPCAST=upcast, PRECISION=precision, Q_ROWS=q_rows is not None,
    )  # fmt: skip
    scores_arg = scores if scores is not None else out  # never read without SCORES
    scored_arg = scored if scored is not None else row_ids  # never read without ROW_FLAGS
    q_rows_arg = q_rows if q_rows is not None else row_ids  # never read without Q_ROWS

    dev = query.device
    if num_splits == 1 or long_tiles:
        extra = {}
        if long_tiles:  # split 0 of the heads past long_tiles tiles, listed; the rest whole
            s_, m_ = num_splits, min_split_tiles
            part_acc = torch.empty((num_rows, num_heads, s_, head_pad), dtype=torch.float32,
                                   device=dev)  # fmt: skip
            part_m, part_l = torch.empty((2, num_rows, num_heads, s_), dtype=torch.float32,
                                         device=dev)  # fmt: skip
            att_items = torch.empty(num_rows * num_kv_heads * s_, dtype=torch.int32, device=dev)
            score_items = torch.empty_like(att_items)  # (apart: both 16-byte aligned)
            done = torch.empty(num_rows * num_kv_heads, dtype=torch.int32, device=dev)
            count = torch.zeros(2, dtype=torch.int32, device=dev)
            long_args = dict(NUM_KV_HEADS=num_kv_heads, NUM_HEADS=num_heads, MIN_TILES=m_)
            extra = dict(part_acc_ptr=part_acc, part_m_ptr=part_m, part_l_ptr=part_l,
                         att_items_ptr=att_items, score_items_ptr=score_items, count_ptr=count,
                         done_ptr=done, LONG_SPLITS=s_, SPLIT_PAD=triton.next_power_of_2(s_),
                         LONG_TILES=long_tiles, **long_args)  # fmt: skip
        _decode_kernel[(num_rows, num_kv_heads)](
            out, query, k_cache, v_cache, block_tables, seq_lens, row_ids, q_rows_arg,
            scores_arg, scored_arg, qk_scale, window,
            strides[0], strides[1], out.stride(0), out.stride(1), *strides[2:],
            SCORES=scores is not None, ROW_FLAGS=scored is not None, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **extra, **consts,
        )  # fmt: skip
        if not long_tiles:
            return out
        # the listed heads' other splits (the last to finish a head combines it), then their
        # scores; persistent grids, each program taking items p, p + P, ...
        glob_m, glob_l = torch.empty((2, num_rows, num_heads), dtype=torch.float32, device=dev)
        programs = (min(num_rows * num_kv_heads * s_, _num_sms(dev) * LONG_PROGRAMS_PER_SM),)
        _long_split_kernel[programs](
            att_items, count, done, part_acc, part_m, part_l, glob_m, glob_l, out, query, k_cache,
            v_cache, block_tables, seq_lens, row_ids, q_rows_arg, qk_scale, window, *strides,
            out.stride(0), out.stride(1), NUM_SPLITS=s_, SPLIT_PAD=triton.next_power_of_2(s_),
            num_warps=cfg.num_warps, num_stages=cfg.split_num_stages, **long_args, **consts,
        )  # fmt: skip
        if scores is not None:
            _long_score_kernel[programs](
                score_items, count, scores, scored_arg, glob_m, glob_l, query, k_cache,
                block_tables, seq_lens, row_ids, q_rows_arg, qk_scale, window, *strides,
                NUM_SPLITS=s_, ROW_FLAGS=scored is not None, num_warps=cfg.num_warps,
                num_stages=cfg.split_num_stages, **long_args, **consts,
            )  # fmt: skip
        return out

    part_acc = torch.empty((num_rows, num_heads, num_splits, head_pad), dtype=torch.float32,
                           device=dev)  # fmt: skip
    part_m = torch.empty((num_rows, num_heads, num_splits), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    grid = (num_rows, num_kv_heads, num_splits)
    _split_kernel[grid](
        part_acc, part_m, part_l, query, k_cache, v_cache, block_tables, seq_lens, row_ids,
        q_rows_arg, qk_scale, window, *strides, NUM_HEADS=num_heads, NUM_SPLITS=num_splits,
        num_warps=cfg.num_warps, num_stages=cfg.split_num_stages, MIN_TILES=min_split_tiles,
        **consts,
    )  # fmt: skip
    if scores is not None:
        glob_m = torch.empty((num_rows, num_heads), dtype=torch.float32, device=dev)
        glob_l = torch.empty_like(glob_m)
    else:
        glob_m = glob_l = part_m  # never written without STORE_ML
    _combine_kernel[(num_rows, num_heads)](
        out, glob_m, glob_l, part_acc, part_m, part_l, q_rows_arg, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits,
        SPLIT_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        STORE_ML=scores is not None, Q_ROWS=q_rows is not None,
        num_warps=4 if head_pad >= 128 else 2,
    )  # fmt: skip
    if scores is not None:
        _split_score_kernel[grid](
            scores, scored_arg, glob_m, glob_l, query, k_cache, block_tables, seq_lens,
            row_ids, q_rows_arg, qk_scale, window,
            *strides, NUM_HEADS=num_heads, NUM_SPLITS=num_splits, num_warps=cfg.num_warps,
            num_stages=cfg.split_num_stages, ROW_FLAGS=scored is not None,
            MIN_TILES=min_split_tiles, **consts,
        )  # fmt: skip
    return out


# The chunk count varies from step to step: no specialization on its value (Triton would
# compile one kernel for 1, one for multiples of 16 and one for the rest), nor on the
# alignment of the index tensors (views at any offset of one shipped buffer).
@triton.jit(
    do_not_specialize=["num_reqs"],
    do_not_specialize_on_alignment=["qsl_ptr", "q_start_ptr", "row_ids_ptr"],
)
def _prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, head_dim]
    v_cache_ptr,
    bt_ptr,  # [rows, num_kv_heads, max_blocks] int32 (columns contiguous)
    lens_ptr,  # [rows, num_kv_heads] int32/int64
    qsl_ptr,  # [num_reqs + 1]: the chunks' boundaries counted over the chunks alone
    q_start_ptr,  # [num_reqs]: query row of each chunk's first query
    row_ids_ptr,  # [num_reqs]: table/length row of each chunk
    num_reqs,
    qk_scale,
    window,  # 0 = no sliding window
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_br,
    stride_bh,
    stride_lr,
    stride_lh,
    stride_cb,
    stride_cs,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # BLOCK_M // G query tokens per tile
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    STORE_LSE: tl.constexpr = False,  # write each row's log2-sum-exp2 to lse_ptr
    lse_ptr=None,  # [num_tokens, num_heads] float32 (with STORE_LSE)
    stride_lse=0,
):
    """One program per (query tile of one chunk, KV head): the tile's queries x the G query
    heads of the KV head, over that head's own table and length (see
    :func:`kvc_paged_attention`); the loop over key tiles is the unified paged kernel's."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    r = _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q)
    c_start = tl.load(qsl_ptr + r)
    q_len = (tl.load(qsl_ptr + r + 1) - c_start).to(tl.int32)
    local = (pid - (c_start // BLOCK_Q + r)).to(tl.int32)  # tile index within the chunk
    if local * BLOCK_Q >= q_len:
        return
    trow = tl.load(row_ids_ptr + r).to(tl.int64)
    seq_len = tl.load(lens_ptr + trow * stride_lr + kvh * stride_lh).to(tl.int32)
    ctx = seq_len - q_len  # keys of this head before the chunk's new ones

    # q_pos: the logical index of each row's own key in this head
    q, q_pos, win_lo, tok, head, d, io_mask, first_pos, key_end, tile_lo, tile_hi = _query_tile(
        q_ptr, tl.load(q_start_ptr + r).to(tl.int64), q_len, ctx, local, kvh, window,
        stride_qt, stride_qh, G, HEAD_DIM, HEAD_PAD, BLOCK_M, BLOCK_Q, TILE_N,
    )  # fmt: skip
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _paged_attend_range(
        acc, l_i, m_i, q, q_pos, win_lo, k_cache_ptr, v_cache_ptr,
        bt_ptr + trow * stride_br + kvh * stride_bh, 0, tile_lo, tile_hi, first_pos, key_end,
        window, qk_scale, stride_cb, stride_cs, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST,
        PRECISION,
    )  # fmt: skip
    _store_tile(out_ptr, acc, l_i, tok, head, d, io_mask, stride_ot, stride_oh)
    if STORE_LSE:  # m + log2(l): the softmax's normalizer in log2 units (the window scores')
        m = tl.arange(0, BLOCK_M)
        row_ok = (m < BLOCK_Q * G) & (local * BLOCK_Q + m // G < q_len)
        tl.store(lse_ptr + tok * stride_lse + head, m_i + tl.log2(l_i), mask=row_ok)


def kvc_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, head_dim]
    query_start_loc: torch.Tensor,  # [R + 1] int32/int64: chunk boundaries, on the device
    seq_lens: torch.Tensor,  # [rows, num_kv_heads] int32/int64: keys per head incl. the new
    block_tables: torch.Tensor,  # [rows, num_kv_heads, max_blocks] int32
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    row_ids: torch.Tensor | None = None,  # [R]: each chunk's table row (None: 0..R-1)
    q_start: torch.Tensor | None = None,  # [R]: each chunk's first query row (None: qsl[:-1])
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]: written in place
    num_chunk_tokens: int | None = None,  # a host bound on qsl[-1] (None: num_tokens)
    tile_config: TileConfig | None = None,  # override the launch shape (tuning, tests)
    lse: torch.Tensor | None = None,  # [num_tokens, num_heads] float32, written for chunk rows
) -> torch.Tensor:
    """Causal attention of prefill chunks (any q_len >= 1) over per-head paged KVs; returns
    ``out`` [num_tokens, num_heads, head_dim] (rows of no chunk are left as they were, 0 when
    ``out`` is None). No scores; with ``lse``, each chunk row's log2-sum-exp2 of its scaled
    logits (``log2 sum_k 2^(q.k * scale * log2 e)``), which :func:`kvc_window_scores` needs.

    Chunk r has ``q_len = qsl[r + 1] - qsl[r]`` queries, at query rows ``q_start[r] ..
    q_start[r] + q_len - 1`` (``qsl[r]..`` without ``q_start``), and reads table row
    ``t = row_ids[r]``; its q_len new keys are the last q_len logical indices of every head,
    so its query i sees, in KV head h, the logical indices ``<= seq_lens[t, h] - q_len + i``
    (and ``>`` that ``- W`` with a window W).

    One program per (query tile of a chunk, KV head) reads that head's table and length in
    place and the tile's query rows by index: no per-call copy of the query, the output, the
    tables or the lengths (every layer of a step passes the cache's whole tables, the step's
    index tensors made once). Example: a step of tokens [decode, a, a, a, decode, b, b]
    with table rows 7 (a) and 2 (b) -> qsl [0, 3, 5], q_start [1, 5], row_ids [7, 2].
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = seq_lens.shape[1]
    num_reqs = query_start_loc.shape[0] - 1
    assert kv_cache.dim() == 4 and kv_cache.shape[0] == 2 and kv_cache.shape[3] == head_dim
    assert block_tables.dim() == 3 and block_tables.shape[:2] == seq_lens.shape
    assert num_heads % num_kv_heads == 0
    g = num_heads // num_kv_heads
    dev = query.device
    if out is None:
        out = torch.zeros(query.shape, dtype=query.dtype, device=dev)
    assert out.shape == query.shape and out.stride(2) == 1
    if num_tokens == 0 or num_reqs <= 0:
        return out
    if row_ids is None:
        assert seq_lens.shape[0] >= num_reqs
        row_ids = torch.arange(num_reqs, device=dev)
    if q_start is None:
        q_start = query_start_loc[:-1]
    assert row_ids.shape == (num_reqs,) and q_start.shape == (num_reqs,)
    if query.stride(2) != 1:
        query = query.contiguous()
    if block_tables.stride(2) != 1:
        block_tables = block_tables.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    assert k_cache.stride(2) == 1 and k_cache.stride() == v_cache.stride()
    block_size = kv_cache.shape[2]
    window = int(sliding_window) if sliding_window else 0
    qk_scale = float(scale) * LOG2E
    head_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 on a GPU
    upcast = query.device.type == "cpu"  # the CPU interpreter mis-computes 16-bit dots
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    cfg = tile_config or default_tile_config(
        head_pad, False, max_query_len, query.device, kv_cache.element_size()
    )
    block_m = max(cfg.block_m, triton.next_power_of_2(g))
    if tile_config is None and max_query_len * g < block_m:
        # short chunks: a tile just big enough for one chunk's queries x heads (as
        # paged_attention). Example: 5-token chunks, G 2 -> block_m 16 (BLOCK_Q 8)
        block_m = max(16, triton.next_power_of_2(max_query_len * g))
    block_q = block_m // g
    n_tok = num_tokens if num_chunk_tokens is None else num_chunk_tokens
    lse_args = {}
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == (num_tokens, num_heads)
        assert lse.stride(1) == 1
        lse_args = dict(STORE_LSE=True, lse_ptr=lse, stride_lse=lse.stride(0))
    # an upper bound on the tiles of all chunks (see paged_attention's _find_request)
    grid = (n_tok // block_q + num_reqs, num_kv_heads)
    _prefill_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, q_start, row_ids,
        num_reqs, qk_scale, window, query.stride(0), query.stride(1), out.stride(0),
        out.stride(1), block_tables.stride(0), block_tables.stride(1), seq_lens.stride(0),
        seq_lens.stride(1), k_cache.stride(0), k_cache.stride(1), G=g, HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q,
        TILE_N=cfg.tile_n, UPCAST=upcast, PRECISION=precision, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **lse_args,
    )  # fmt: skip
    return out


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
    j = tile * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] logical indices
    bt_row = bt_ptr + trow * stride_br + kvh * stride_bh  # (table columns contiguous)
    j_ok, blk, off = _tile_keys(bt_row, 1, tile, 0, seq_len, BLOCK_SIZE, TILE_N, True)
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
    j = tile * TILE_N + tl.arange(0, TILE_N)
    bt_row = bt_ptr + trow * stride_br + kvh * stride_bh  # (table columns contiguous)
    j_ok, blk, off = _tile_keys(bt_row, 1, tile, 0, seq_len, BLOCK_SIZE, TILE_N, True)
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
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = seq_lens.shape[1]
    g = num_heads // num_kv_heads
    k_cache = kv_cache[0]
    block_size = kv_cache.shape[2]
    assert scores.dtype == torch.float32 and scores.is_contiguous()
    assert lse.dtype == torch.float32 and lse.stride(1) == 1 and query.stride(2) == 1
    assert block_tables.stride(2) == 1 and window_rows.is_contiguous()
    head_pad = max(16, triton.next_power_of_2(head_dim))
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
        metric, scores, query, lse, k_cache, block_tables, seq_lens, window_reqs, window_rows,
        window_n, max_len, float(scale) * LOG2E, query.stride(0), query.stride(1),
        lse.stride(0), block_tables.stride(0), block_tables.stride(1), seq_lens.stride(0),
        seq_lens.stride(1), k_cache.stride(0), k_cache.stride(1), C=c, G=g, HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m, TILE_N=tile_n, POOL=pool,
        UPCAST=query.device.type == "cpu",
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
    if pool:
        _window_pool_kernel[grid](
            scores, metric, block_tables, seq_lens, window_reqs, max_len,
            block_tables.stride(0), block_tables.stride(1), seq_lens.stride(0),
            seq_lens.stride(1), KERNEL=maxpool_kernel, BLOCK_SIZE=block_size, TILE_N=tile_n,
            num_warps=2,
        )  # fmt: skip
