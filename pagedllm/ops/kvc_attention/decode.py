"""KV-Compress's decode attention: one query token per row over the per-head paged cache
(layout: :mod:`pagedllm.ops.kvc_attention`), scoring the keys on the way.

One program per (row, KV head) serves the G query heads of the group, so every K/V tile is
read once per group (the token's own key is already the head's last). Online softmax over
tiles of ``TILE_N`` logical indices; tiles that lie wholly inside ``[len - window, len)`` skip
the masks. With ``scores`` a second pass over the same keys, once the softmax's max and sum are
final, recomputes q.k and adds ``sum over the group of p^2`` to each key's slot (each slot
belongs to one (row, head), so a plain load/add/store suffices); the pass reads K again.

Long contexts at small batch: split-K (the count from :func:`kvc_decode_num_splits` unless
given), ``num_splits`` programs per (row, KV head) over equal slices of the head's tiles writing
partial (acc, max, sum), a combine kernel per (row, query head), then (with scores) a score
pass per split that uses the combined max and sum; the slice length is computed in the kernel
from ``seq_lens``, at least ``min_split_tiles`` tiles. Uneven heads at a batch that fills the
SMs (:data:`SKEW_SPLITS`, for scored rows): the single pass keeps the short heads and splits
only the long ones (``long_tiles``). The split kernels live in :mod:`.decode_split`; every
launch is made here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.ops.kvc_attention.common import (
    _INDEX_PTRS,
    DecodeInputs,
    HeadCacheArgs,
    Partials,
    _attend_range,
    _group_setup,
    _score_range,
    _scored_tiles,
    _split_tiles,
    _store_partial,
    _used_splits,
)
from pagedllm.ops.kvc_attention.decode_split import (
    _combine_kernel,
    _long_score_kernel,
    _long_split_kernel,
    _split_kernel,
    _split_score_kernel,
)
from pagedllm.ops.paged_attention import TileConfig, _num_sms, default_tile_config


class SkewSplits(NamedTuple):
    """How a single-pass decode splits its long heads: a head longer than ``long_tiles`` key
    tiles runs in up to ``splits`` splits of at least ``min_tiles`` tiles each, the shorter
    heads whole (``kvc_decode_attention``'s ``num_splits``, ``min_split_tiles`` and
    ``long_tiles``)."""

    splits: int
    min_tiles: int
    long_tiles: int


# Scored decode rows at a batch that fills the SMs (one program per (row, KV head), no split)
# split their heads longer than 16 key tiles into up to 8 splits of at least 8 tiles each; the
# single pass keeps the others. KV-Compress's evictions leave a layer's heads uneven - a few
# keep a whole prompt - and one program per head would wait on its longest head. Splitting
# every head instead (a grid of rows x heads x splits) costs the short heads' empty programs.
# Benchmark D (``benchmarks/kvcompress_throughput.py``, its evictions leave the heads uneven)
# measures it. None: no head is split.
SKEW_SPLITS: SkewSplits | None = SkewSplits(splits=8, min_tiles=8, long_tiles=16)

# ``long_tiles``: the persistent kernels' programs per SM (long heads' splits and scores).
LONG_PROGRAMS_PER_SM = 2


# --------------------------------------------------------------------------------------------
# Device side: the single pass
# --------------------------------------------------------------------------------------------


@triton.jit
def _finish_head(
    out_ptr, stride_ot, stride_oh, scores_ptr, scored_ptr, inp, row, q, qrow, head, row_mask,
    acc, l_i, m_i, keys, tile_lo, tile_hi, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
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
        tile_hi = _scored_tiles(scored_ptr, inp.row_ids_ptr, row, tile_lo, tile_hi, ROW_FLAGS)
        _score_range(q, m_fin, inv_l, scores_ptr, keys, tile_lo, tile_hi, inp.qk_scale,
                     HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST, PRECISION)  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=_INDEX_PTRS)
def _decode_kernel(
    out_ptr,  # [rows, num_heads, head_dim]
    scores_ptr,  # [num_blocks * block_size] fp32 (unused without SCORES)
    scored_ptr,  # [table rows] int32: 0 = the row's keys are not scored (read with ROW_FLAGS)
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr, q_rows_ptr, qk_scale, window,
    stride_qt, stride_qh, stride_br, stride_bh, stride_bb, stride_lr, stride_lh, stride_cb,
    stride_cs,  # DecodeInputs
    stride_ot,
    stride_oh,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, SCORES: tl.constexpr, ROW_FLAGS: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, Q_ROWS: tl.constexpr,
    # LONG_SPLITS > 0: a head longer than LONG_TILES tiles gets only its split 0 here (of
    # its n non-empty splits, at most LONG_SPLITS of at least MIN_TILES tiles each:
    # ``_split_tiles``): that partial, (-inf, 0) for its empty splits, 1 - n in ``done``, its
    # splits 1..n-1 listed in ``att_items`` and (SCORES, a scored row) 0..n-1 in ``score_items``
    part_acc_ptr=None,  # Partials [rows, num_heads, LONG_SPLITS, HEAD_PAD] fp32
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
):  # fmt: skip
    """One program per (row, KV head): the G query heads' output and (SCORES) the keys'
    scores (with ROW_FLAGS only for table rows whose ``scored`` flag is set); with
    LONG_SPLITS, a long head's split 0 (see :mod:`.decode_split`)."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    inp = DecodeInputs(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, lens_ptr, row_ids_ptr,
                       q_rows_ptr, qk_scale, window, stride_qt, stride_qh, stride_br, stride_bh,
                       stride_bb, stride_lr, stride_lh, stride_cb, stride_cs)  # fmt: skip
    q, row_mask, head, keys, tile_lo, tile_hi, qrow = _group_setup(
        inp, row, kvh, G, HEAD_DIM, HEAD_PAD, BLOCK_M, TILE_N, Q_ROWS
    )
    if LONG_SPLITS > 0:  # a long head's split 0; all the tiles of a short one
        split0_hi = _split_tiles(tile_lo, tile_hi, 0, LONG_SPLITS, MIN_TILES)[1]
        att_hi = tl.where(tile_hi - tile_lo <= LONG_TILES, tile_hi, split0_hi)
    else:
        att_hi = tile_hi
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attend_range(acc, l_i, m_i, q, keys, tile_lo, att_hi, qk_scale, HEAD_DIM,
                                  HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST, PRECISION)  # fmt: skip
    if LONG_SPLITS > 0:
        if att_hi == tile_hi:
            _finish_head(out_ptr, stride_ot, stride_oh, scores_ptr, scored_ptr, inp, row, q, qrow,
                         head, row_mask, acc, l_i, m_i, keys, tile_lo, tile_hi, HEAD_DIM, HEAD_PAD,
                         BLOCK_SIZE, TILE_N, SCORES, ROW_FLAGS, UPCAST, PRECISION)  # fmt: skip
        else:
            # Example: NUM_HEADS 32, LONG_SPLITS 8, row 2, head 5 -> part row (2 * 32 + 5) * 8.
            prow = (row.to(tl.int64) * NUM_HEADS + head) * LONG_SPLITS
            _store_partial(Partials(part_acc_ptr, part_m_ptr, part_l_ptr), prow, acc, m_i, l_i,
                           row_mask, row_mask, HEAD_PAD)  # fmt: skip
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
        _finish_head(out_ptr, stride_ot, stride_oh, scores_ptr, scored_ptr, inp, row, q, qrow,
                     head, row_mask, acc, l_i, m_i, keys, tile_lo, tile_hi, HEAD_DIM, HEAD_PAD,
                     BLOCK_SIZE, TILE_N, SCORES, ROW_FLAGS, UPCAST, PRECISION)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def kvc_decode_tile_config(
    head_pad: int, scores: bool, device: torch.device, elem_bytes: int
) -> TileConfig:
    """Launch shape of the single-pass decode kernel: without the score pass, 128-key tiles
    and 3 stages where the device's shared memory holds 3 stages of K and V tiles (Hopper, 16-
    bit caches up to head size 128: 192 KB of 227); otherwise (the score pass reads K a second
    time) the unified kernel's decode default, 64-key tiles and 2 stages (32-key tiles at head
    size 256). The split path keeps that default too. ``benchmarks/attn_decode_sweep.py``
    measures these shapes on Benchmark A's and B's decode batches (layout ``kvc`` without the
    score pass, ``kvcs`` with it built in and every row's flag 0, as never-evicting requests
    run it).
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
    with one program per (row, KV head) and constants of its own: split only when the programs
    do not fill the SMs (rows x KV heads < SMs), into the largest power of two that keeps
    programs x splits <= 2 per SM, at most 64 and at most the tiles of ``max_len`` keys.
    ``max_len`` bounds the heads' lengths on the host (the decode entry point passes the block
    tables' capacity, ``max_blocks * block_size``, or the window if smaller).
    Example (132 SMs, 8 KV heads): 1 row -> 8 programs -> 32 splits at 32k keys; 8 rows -> 4;
    32 rows (256 programs) -> 1. ``benchmarks/attn_decode_sweep.py`` times split counts.
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


@dataclass(frozen=True)
class DecodeArgs:
    """One decode launch's shared arguments: :meth:`args` yields them in
    :class:`.common.DecodeInputs`' order (every decode kernel takes them after its own
    buffers), :meth:`consts` the constexprs they share."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim], rows contiguous
    cache: HeadCacheArgs
    row_ids: torch.Tensor  # [rows] int64: each row's table row
    q_rows: torch.Tensor | None  # [rows] int64: each row's query / output row (None: the row)
    window: int  # 0 = no sliding window
    tile_n: int

    @property
    def num_rows(self) -> int:
        return self.row_ids.shape[0]

    @property
    def num_heads(self) -> int:
        return self.query.shape[1]

    def args(self, values: bool = True) -> tuple:
        """The kernels' shared arguments; without ``values`` no V cache (the score kernels)."""
        c = self.cache
        q_rows = self.q_rows if self.q_rows is not None else self.row_ids  # unread: no Q_ROWS
        v = (c.v_cache,) if values else ()
        return (
            self.query, c.k_cache, *v, c.block_tables, c.seq_lens, self.row_ids, q_rows,
            c.qk_scale, self.window, self.query.stride(0), self.query.stride(1),
            *c.strides(columns=True),
        )  # fmt: skip

    def consts(self) -> dict[str, Any]:
        g = self.num_heads // self.cache.num_kv_heads
        return dict(self.cache.consts(), G=g, BLOCK_M=max(16, triton.next_power_of_2(g)),
                    TILE_N=self.tile_n, Q_ROWS=self.q_rows is not None)  # fmt: skip


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
    num_tokens, _, head_dim = query.shape
    if row_ids is None:
        num_rows = seq_lens.shape[0]
        row_ids = torch.arange(num_rows, device=query.device)
    else:
        num_rows = row_ids.shape[0]
    assert q_rows is None or q_rows.shape == (num_rows,)
    assert num_tokens >= num_rows
    cache = HeadCacheArgs.of(query, kv_cache, block_tables, seq_lens, scale)
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
    if scores is not None:
        assert scores.dtype == torch.float32 and scores.is_contiguous()
        assert scores.numel() >= kv_cache.shape[1] * cache.block_size
    window = int(sliding_window) if sliding_window else 0
    # the split count comes from the split path's launch shape
    cfg = tile_config or default_tile_config(cache.head_pad, decode=True)
    if num_splits is None:
        num_splits = kvc_decode_auto_splits(
            num_rows, block_tables, cache.block_size, window, head_dim, query.device, cfg.tile_n
        )
        if num_splits == 1 and scores is not None and SKEW_SPLITS is not None:
            s, m, t = SKEW_SPLITS  # (a head longer than T tiles can exist: split the long ones)
            capacity = block_tables.shape[2] * cache.block_size
            if min(capacity, window or capacity) > t * cfg.tile_n:
                num_splits, min_split_tiles, long_tiles = s, m, t
    assert num_splits >= 1 and min_split_tiles >= 1 and long_tiles >= 0
    assert not long_tiles or num_splits > 1, "long_tiles needs num_splits > 1"
    if tile_config is None and num_splits == 1:
        cfg = kvc_decode_tile_config(
            cache.head_pad, scores is not None, query.device, kv_cache.element_size()
        )
    a = DecodeArgs(query, cache, row_ids, q_rows, window, cfg.tile_n)
    if num_splits == 1 or long_tiles:
        long = SkewSplits(num_splits, min_split_tiles, long_tiles) if long_tiles else None
        _single_pass(a, out, scores, scored, cfg, long)
    else:
        _split_k(a, out, scores, scored, cfg, num_splits, min_split_tiles)
    return out


def _single_pass(
    a: DecodeArgs,
    out: torch.Tensor,
    scores: torch.Tensor | None,
    scored: torch.Tensor | None,
    cfg: TileConfig,
    long: SkewSplits | None,  # split the heads longer than long.long_tiles tiles
) -> None:
    """One program per (row, KV head); with ``long``, split 0 of each long head there, its
    other splits and their scores in the persistent kernels (:mod:`.decode_split`)."""
    rows, kv_heads, heads, dev = a.num_rows, a.cache.num_kv_heads, a.num_heads, a.query.device
    flags = dict(SCORES=scores is not None, ROW_FLAGS=scored is not None)
    scores_arg = scores if scores is not None else out  # never read without SCORES
    scored_arg = scored if scored is not None else a.row_ids  # never read without ROW_FLAGS
    extra: dict[str, Any] = {}
    if long is not None:  # split 0 of the heads past long_tiles tiles, listed; the rest whole
        s = long.splits
        part_acc = torch.empty((rows, heads, s, a.cache.head_pad), dtype=torch.float32,
                               device=dev)  # fmt: skip
        part_m, part_l = torch.empty((2, rows, heads, s), dtype=torch.float32, device=dev)
        att_items = torch.empty(rows * kv_heads * s, dtype=torch.int32, device=dev)
        score_items = torch.empty_like(att_items)  # (apart: both 16-byte aligned)
        done = torch.empty(rows * kv_heads, dtype=torch.int32, device=dev)
        count = torch.zeros(2, dtype=torch.int32, device=dev)
        long_args = dict(NUM_KV_HEADS=kv_heads, NUM_HEADS=heads, MIN_TILES=long.min_tiles)
        extra = dict(part_acc_ptr=part_acc, part_m_ptr=part_m, part_l_ptr=part_l,
                     att_items_ptr=att_items, score_items_ptr=score_items, count_ptr=count,
                     done_ptr=done, LONG_SPLITS=s, SPLIT_PAD=triton.next_power_of_2(s),
                     LONG_TILES=long.long_tiles, **long_args)  # fmt: skip
    _decode_kernel[(rows, kv_heads)](
        out, scores_arg, scored_arg, *a.args(), out.stride(0), out.stride(1),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags, **extra, **a.consts(),
    )  # fmt: skip
    if long is None:
        return
    # the listed heads' other splits (the last to finish a head combines it), then their
    # scores; persistent grids, each program taking items p, p + P, ...
    glob_m, glob_l = torch.empty((2, rows, heads), dtype=torch.float32, device=dev)
    programs = (min(rows * kv_heads * s, _num_sms(dev) * LONG_PROGRAMS_PER_SM),)
    launch = dict(NUM_SPLITS=s, num_warps=cfg.num_warps, num_stages=cfg.split_num_stages,
                  **long_args, **a.consts())  # fmt: skip
    _long_split_kernel[programs](
        att_items, count, done, part_acc, part_m, part_l, glob_m, glob_l, out, *a.args(),
        out.stride(0), out.stride(1), SPLIT_PAD=triton.next_power_of_2(s), **launch,
    )  # fmt: skip
    if scores is not None:
        _long_score_kernel[programs](
            score_items, count, scores, scored_arg, glob_m, glob_l, *a.args(values=False),
            ROW_FLAGS=scored is not None, **launch,
        )  # fmt: skip


def _split_k(
    a: DecodeArgs,
    out: torch.Tensor,
    scores: torch.Tensor | None,
    scored: torch.Tensor | None,
    cfg: TileConfig,
    num_splits: int,
    min_split_tiles: int,
) -> None:
    """``num_splits`` programs per (row, KV head) writing partials, a combine per (row, query
    head), then (with scores) a score pass per split from the combined max and sum."""
    rows, heads, dev = a.num_rows, a.num_heads, a.query.device
    head_pad = a.cache.head_pad
    part_acc = torch.empty((rows, heads, num_splits, head_pad), dtype=torch.float32, device=dev)
    part_m = torch.empty((rows, heads, num_splits), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    grid = (rows, a.cache.num_kv_heads, num_splits)
    launch = dict(
        NUM_HEADS=heads, NUM_SPLITS=num_splits, MIN_TILES=min_split_tiles,
        num_warps=cfg.num_warps, num_stages=cfg.split_num_stages, **a.consts(),
    )  # fmt: skip
    _split_kernel[grid](part_acc, part_m, part_l, *a.args(), **launch)
    if scores is not None:
        glob_m = torch.empty((rows, heads), dtype=torch.float32, device=dev)
        glob_l = torch.empty_like(glob_m)
    else:
        glob_m = glob_l = part_m  # never written without STORE_ML
    q_rows = a.q_rows if a.q_rows is not None else a.row_ids  # never read without Q_ROWS
    _combine_kernel[(rows, heads)](
        out, glob_m, glob_l, part_acc, part_m, part_l, q_rows, out.stride(0), out.stride(1),
        NUM_HEADS=heads, NUM_SPLITS=num_splits, SPLIT_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=a.cache.head_dim, HEAD_PAD=head_pad, STORE_ML=scores is not None,
        Q_ROWS=a.q_rows is not None, num_warps=4 if head_pad >= 128 else 2,
    )  # fmt: skip
    if scores is not None:
        scored_arg = scored if scored is not None else a.row_ids  # never read without ROW_FLAGS
        _split_score_kernel[grid](
            scores, scored_arg, glob_m, glob_l, *a.args(values=False),
            ROW_FLAGS=scored is not None, **launch,
        )  # fmt: skip
