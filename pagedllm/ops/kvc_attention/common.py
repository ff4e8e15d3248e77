"""What the KV-Compress kernels of this package share.

Host side: :class:`HeadCacheArgs`, one launch's per-head cache and query settings, checked
once and handed to every kernel in one order. Device side: one (row, KV head)'s keys read tile
by tile through its own block table (:class:`HeadKeys`), the online softmax and the score pass
over a range of tiles, and what a decode program of (row, KV head) starts from
(:class:`DecodeInputs`, :func:`_group_setup`).

The device bundles are named tuples of runtime values (pointers, strides, lengths) that a
kernel builds from its own arguments and passes whole to the helpers; Triton flattens them, so
the compiled code is the one of the flat argument lists. Constexprs stay separate arguments
(a constexpr inside a tuple is no longer one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# The step's index tensors (table rows, query rows) are views at any offset of one shipped
# buffer: no specialization on their alignment, or a mixed step's decode rows would meet new
# kernel variants (a Triton compile each, seconds) long after the warm-up.
_INDEX_PTRS = ["row_ids_ptr", "q_rows_ptr", "scored_ptr"]


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadCacheArgs:
    """One launch's per-head paged cache and query settings, in the forms the kernels take.

    ``k_cache`` / ``v_cache`` [num_blocks, block_size, head_dim] (rows contiguous, K and V
    strided alike), ``block_tables`` [rows, num_kv_heads, max_blocks] int32 and ``seq_lens``
    [rows, num_kv_heads] (either may be a strided view). ``qk_scale`` is the softmax scale
    times log2(e): the kernels work in exp2. ``precision``: ``tl.dot``'s input precision
    ("ieee" for float32 queries, else "tf32"); ``upcast``: dots in float32 (the CPU
    interpreter mis-computes 16-bit dots).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    qk_scale: float
    head_dim: int
    precision: str
    upcast: bool

    @classmethod
    def of(
        cls,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, head_dim] (0 = K, 1 = V)
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> HeadCacheArgs:
        head_dim = query.shape[2]
        assert kv_cache.dim() == 4 and kv_cache.shape[0] == 2 and kv_cache.shape[3] == head_dim
        assert block_tables.dim() == 3 and block_tables.shape[:2] == seq_lens.shape
        assert query.shape[1] % seq_lens.shape[1] == 0
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        assert k_cache.stride(2) == 1 and k_cache.stride() == v_cache.stride()
        precision = "ieee" if query.dtype == torch.float32 else "tf32"
        upcast = query.device.type == "cpu"
        return cls(k_cache, v_cache, block_tables, seq_lens, float(scale) * LOG2E, head_dim,
                   precision, upcast)  # fmt: skip

    @property
    def num_kv_heads(self) -> int:
        return self.seq_lens.shape[1]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def head_pad(self) -> int:
        """The head size padded for ``tl.dot``: a power of two, at least 16 (a GPU's K)."""
        return max(16, triton.next_power_of_2(self.head_dim))

    def strides(self, columns: bool = False, cache: bool = True) -> tuple[int, ...]:
        """The strides every kernel here takes, in its order: the tables' (``stride_br``,
        ``stride_bh``, with ``columns`` ``stride_bb``), the lengths' (``stride_lr``,
        ``stride_lh``) and with ``cache`` the cache's (``stride_cb``, ``stride_cs``)."""
        bt = self.block_tables.stride()
        kv = self.k_cache.stride()[:2] if cache else ()
        return (*(bt if columns else bt[:2]), *self.seq_lens.stride(), *kv)

    def consts(self) -> dict[str, Any]:
        """The constexprs every attention kernel here takes."""
        return dict(HEAD_DIM=self.head_dim, HEAD_PAD=self.head_pad, BLOCK_SIZE=self.block_size,
                    UPCAST=self.upcast, PRECISION=self.precision)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Device side: one head's keys
# --------------------------------------------------------------------------------------------


class HeadKeys(NamedTuple):
    """One (row, KV head)'s keys, on the device: its block-table row (``table``, columns
    ``col_stride`` apart), the K and V caches (the row of slot (block, offset) at ``block *
    block_stride + offset * slot_stride``) and the visible logical indices ``[lo, hi)``."""

    table: Any
    col_stride: Any
    k_ptr: Any
    v_ptr: Any
    block_stride: Any
    slot_stride: Any
    lo: Any
    hi: Any


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
def _head_tile(keys, tile, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """Tile ``tile`` of a head's keys (:class:`HeadKeys`): (visible, block id, offset, K rows
    [TILE_N, HEAD_PAD])."""
    ok, blk, off = _tile_keys(keys.table, keys.col_stride, tile, keys.lo, keys.hi, BLOCK_SIZE,
                              TILE_N, MASKED)  # fmt: skip
    k = _load_rows(keys.k_ptr, blk, off, ok, keys.block_stride, keys.slot_stride, HEAD_DIM,
                   HEAD_PAD, MASKED)  # fmt: skip
    return ok, blk, off, k


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
    keys,  # HeadKeys
    tile_lo,
    tile_hi,
    qk_scale,
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
        ok, blk, off, k = _head_tile(keys, tile, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED)
        v = _load_rows(keys.v_ptr, blk, off, ok, keys.block_stride, keys.slot_stride, HEAD_DIM,
                       HEAD_PAD, MASKED)  # fmt: skip
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
            # (an fp8 cache's V in the query's dtype: fp8 is storage, the dot stays 16-bit)
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_range(acc, l_i, m_i, q, keys, tile_lo, tile_hi, qk_scale, HEAD_DIM: tl.constexpr,
                  HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """:func:`_attend_tiles` over tiles ``[tile_lo, tile_hi)`` in three runs: masked,
    mask-free (the tiles wholly inside ``[keys.lo, keys.hi)``), masked."""
    full_lo, full_hi = _full_tiles(tile_lo, tile_hi, keys.lo, keys.hi, TILE_N)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, keys, tile_lo, full_lo, qk_scale, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N,
        UPCAST, PRECISION, True,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, keys, full_lo, full_hi, qk_scale, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N,
        UPCAST, PRECISION, False,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, keys, full_hi, tile_hi, qk_scale, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N,
        UPCAST, PRECISION, True,
    )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _score_tiles(
    q,  # [BLOCK_M, HEAD_PAD]
    m_fin,  # [BLOCK_M] fp32 final max (log2 units; 0 for rows with no key)
    inv_l,  # [BLOCK_M] fp32 1 / final sum; 0 for padding rows (they add nothing)
    scores_ptr,  # [num_blocks * block_size] fp32
    keys,  # HeadKeys (V unread)
    tile_lo,
    tile_hi,
    qk_scale,
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
        ok, blk, off, k = _head_tile(keys, tile, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, MASKED)
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
def _score_range(q, m_fin, inv_l, scores_ptr, keys, tile_lo, tile_hi, qk_scale,
                 HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 TILE_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """:func:`_score_tiles` in three runs: masked, mask-free, masked."""
    full_lo, full_hi = _full_tiles(tile_lo, tile_hi, keys.lo, keys.hi, TILE_N)
    _score_tiles(q, m_fin, inv_l, scores_ptr, keys, tile_lo, full_lo, qk_scale, HEAD_DIM,
                 HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST, PRECISION, True)  # fmt: skip
    _score_tiles(q, m_fin, inv_l, scores_ptr, keys, full_lo, full_hi, qk_scale, HEAD_DIM,
                 HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST, PRECISION, False)  # fmt: skip
    _score_tiles(q, m_fin, inv_l, scores_ptr, keys, full_hi, tile_hi, qk_scale, HEAD_DIM,
                 HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST, PRECISION, True)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Device side: a decode program of (row, KV head)
# --------------------------------------------------------------------------------------------


class DecodeInputs(NamedTuple):
    """The arguments every decode kernel takes after its own buffers, in this order (the
    host's :meth:`decode.DecodeArgs.args` yields them so): the query [rows, num_heads,
    head_dim], the K and V caches (the score kernels read no V: K stands in), the block
    tables and lengths, ``row_ids`` [rows] int64 (each row's table row), ``q_rows`` [rows]
    int64 (each row's query and output row, read with Q_ROWS), the scale in log2 units, the
    sliding window (0: none) and the strides."""

    q_ptr: Any
    k_cache_ptr: Any
    v_cache_ptr: Any
    bt_ptr: Any
    lens_ptr: Any
    row_ids_ptr: Any
    q_rows_ptr: Any
    qk_scale: Any
    window: Any
    stride_qt: Any
    stride_qh: Any
    stride_br: Any
    stride_bh: Any
    stride_bb: Any
    stride_lr: Any
    stride_lh: Any
    stride_cb: Any
    stride_cs: Any


class Partials(NamedTuple):
    """Split-K partials: acc [rows, num_heads, S, HEAD_PAD] fp32, max and sum [rows,
    num_heads, S] fp32 (row ``(row * num_heads + head) * S + split``)."""

    acc_ptr: Any
    m_ptr: Any
    l_ptr: Any


@triton.jit
def _out_row(q_rows_ptr, row, Q_ROWS: tl.constexpr):
    """The query / output row of decode row ``row``: ``q_rows[row]`` with Q_ROWS (a mixed
    step's decode rows, read in place), else ``row`` itself (int64)."""
    if Q_ROWS:
        return tl.load(q_rows_ptr + row).to(tl.int64)
    return row.to(tl.int64)


@triton.jit
def _group_setup(
    inp,  # DecodeInputs
    row,
    kvh,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    Q_ROWS: tl.constexpr,  # False: row ``row`` of the query is the row's (``q_rows`` unread)
):
    """What every decode program of (row, kvh) starts from: the group's query rows
    [BLOCK_M, HEAD_PAD] (row m = query head kvh * G + m; rows >= G are 0), the row mask, the
    query heads, the head's keys (:class:`HeadKeys`: table row ``row_ids[row]``, visible
    logical indices ``[max(len - window, 0), len)``), their tiles [tile_lo, tile_hi) and the
    query row (``q_rows[row]`` with Q_ROWS, else ``row``; int64)."""
    m = tl.arange(0, BLOCK_M)
    row_mask = m < G
    d = tl.arange(0, HEAD_PAD)
    head = kvh * G + m
    qrow = _out_row(inp.q_rows_ptr, row, Q_ROWS)
    q = tl.load(
        inp.q_ptr + qrow * inp.stride_qt + head[:, None] * inp.stride_qh + d[None, :],
        mask=row_mask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    trow = tl.load(inp.row_ids_ptr + row).to(tl.int64)
    bt_row = inp.bt_ptr + trow * inp.stride_br + kvh * inp.stride_bh
    key_hi = tl.load(inp.lens_ptr + trow * inp.stride_lr + kvh * inp.stride_lh).to(tl.int32)
    key_lo = tl.maximum(tl.where(inp.window > 0, key_hi - inp.window, 0), 0)
    tile_lo = key_lo // TILE_N
    tile_hi = (key_hi + TILE_N - 1) // TILE_N
    keys = HeadKeys(bt_row, inp.stride_bb, inp.k_cache_ptr, inp.v_cache_ptr, inp.stride_cb,
                    inp.stride_cs, key_lo, key_hi)  # fmt: skip
    return q, row_mask, head, keys, tile_lo, tile_hi, qrow


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
def _store_partial(part, prow, acc, m_i, l_i, row_mask, busy, HEAD_PAD: tl.constexpr):
    """A split's partial (max, sum, and acc where it had keys) at :class:`Partials` rows
    ``prow``."""
    tl.store(part.m_ptr + prow, m_i, mask=row_mask)
    tl.store(part.l_ptr + prow, l_i, mask=row_mask)
    d = tl.arange(0, HEAD_PAD)
    tl.store(part.acc_ptr + prow[:, None] * HEAD_PAD + d[None, :], acc, mask=busy[:, None])


@triton.jit
def _used_splits(tile_lo, tile_hi, NUM_SPLITS: tl.constexpr, MIN_TILES: tl.constexpr):
    """How many of ``_split_tiles``'s splits have tiles (at least 1).
    Example: 20 tiles, NUM_SPLITS 8, MIN_TILES 1 -> per 3 -> 7; MIN_TILES 8 -> per 8 -> 3."""
    n = tile_hi - tile_lo
    per = tl.maximum((n + NUM_SPLITS - 1) // NUM_SPLITS, MIN_TILES)
    return tl.maximum((n + per - 1) // per, 1)
