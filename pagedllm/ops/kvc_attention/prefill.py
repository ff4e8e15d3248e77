"""Prefill chunks over KV-Compress's per-head paged cache (layout:
:mod:`pagedllm.ops.kvc_attention`).

One program per (query tile of a chunk, KV head), the unified paged kernel's loop over key
tiles (:mod:`pagedllm.ops.paged_attention`) on that head's own table and length; query and
output rows, table rows and lengths are read in place through the step's index tensors (no
per-layer gather or permutation); no scores, but each chunk row's softmax normalizer on
request, for :mod:`.window_scores`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops.kvc_attention.common import HeadCacheArgs
from pagedllm.ops.paged_attention import (
    TileConfig,
    _find_request,
    _query_tile,
    _store_tile,
    default_tile_config,
    unified_block_m,
)
from pagedllm.ops.paged_attention import _attend_range as _paged_attend_range


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
    num_tokens, num_heads, _ = query.shape
    num_kv_heads = seq_lens.shape[1]
    num_reqs = query_start_loc.shape[0] - 1
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
    c = HeadCacheArgs.of(query, kv_cache, block_tables, seq_lens, scale)
    window = int(sliding_window) if sliding_window else 0
    cfg = tile_config or default_tile_config(
        c.head_pad, False, max_query_len, query.device, kv_cache.element_size()
    )
    # short chunks: a tile just big enough for one chunk's queries x heads (as
    # paged_attention; its tile shapes, warmed up at start-up)
    block_m = unified_block_m(cfg, g, max(max_query_len, 2), tuned=tile_config is not None)
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
        out, query, c.k_cache, c.v_cache, c.block_tables, c.seq_lens, query_start_loc, q_start,
        row_ids, num_reqs, c.qk_scale, window, query.stride(0), query.stride(1), out.stride(0),
        out.stride(1), *c.strides(), G=g, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=cfg.tile_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **c.consts(), **lse_args,
    )  # fmt: skip
    return out
