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
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.ops.kvc_attention.common import (
    _INDEX_PTRS,
    LOG2E,
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
# ``benchmarks/kvc_decode_skew.py`` measures these shapes on one layer (even and skewed heads),
# Benchmark D (``benchmarks/kvcompress_throughput.py``) in the engine. None: no head is split.
SKEW_SPLITS: SkewSplits | None = SkewSplits(splits=8, min_tiles=8, long_tiles=16)

# ``long_tiles``: the persistent kernels' programs per SM (long heads' splits and scores).
LONG_PROGRAMS_PER_SM = 2


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
        cfg = kvc_decode_tile_config(
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
