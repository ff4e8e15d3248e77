"""Triton kernels of decode context parallelism (``pagedllm/attention/dcp.py``): attention over
this rank's share of the keys with its log-sum-exp, and the merge weights fused with the layout
the reduce-scatter takes.

``dcp_paged_attention``: the unified paged kernel's tiling (``ops/paged_attention.py``: one
program per query tile of one request and KV head, the GQA group's heads sharing each K/V tile)
over a cache whose page holds this rank's positions only. Rank r of D stores position
p = j * D + r at local index j, so the tile's rows and window, given by position, become bounds
on j: a row at position p sees j <= floor((p - r) / D) and, with a window W,
j > floor((p - W - r) / D). Example: D 2, r 1, a row at position 6 sees local keys 0..2
(positions 1, 3, 5); with W 4 only j > floor(1 / 2) = 0, so 1..2 (positions 3, 5). Every tile is
masked (the bounds differ row to row by at most one key); the kernel writes each row's
normalised output and its log-sum-exp (natural log; -inf where the rank holds no visible key).

``dcp_combine``: rank r's weighted output in the reduce-scatter's layout, one program per
(token, head of the group): weight = exp(lse_r - logsumexp over the D ranks' lse), written to
``[D, num_tokens, H, head_dim]`` at [head // H, token, head % H].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kv_layout import is_fp8
from pagedllm.ops.paged_attention import (
    LOG2E,
    _attend_tiles,
    _find_request,
    _fp16_query,
    _query_tile,
    default_tile_config,
)

LN2 = tl.constexpr(0.6931471805599453)  # (a global a kernel reads must be a constexpr)


@triton.jit(do_not_specialize=["num_reqs", "rank", "stride_bt"])
def _dcp_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] float32
    lse_ptr,  # [num_tokens, num_heads] float32
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, page_tokens, num_kv_heads, head_dim]
    v_cache_ptr,
    bt_ptr,  # [num_reqs, max_blocks] int32
    qsl_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32: whole sequences (the rows' positions)
    num_reqs,
    rank,  # this rank within the DCP group
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
    DCP: tl.constexpr,  # ranks of the group
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # a page's tokens
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    DECODE: tl.constexpr,
    scale_ptr=None,
    QUANT: tl.constexpr = False,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    if DECODE:
        r = pid
    else:
        r = _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    local = pid - (q_start // BLOCK_Q + r)
    if DECODE:
        local = 0
    if local * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + r) - q_len
    q, q_pos, win_lo, tok, head, d, io_mask, first_pos, key_end, tile_lo, tile_hi = _query_tile(
        q_ptr, q_start, q_len, ctx, local, kvh, window, stride_qt, stride_qh,
        G, HEAD_DIM, HEAD_PAD, BLOCK_M, BLOCK_Q, TILE_N,
    )  # fmt: skip
    # positions -> this rank's local indices (see the module docstring; no negative floors)
    q_loc = tl.where(q_pos >= rank, (q_pos - rank) // DCP, -1)
    win_loc = tl.where(win_lo >= rank, (win_lo - rank) // DCP, -1)
    key_start = tl.maximum(tl.where(window > 0, first_pos - window + 1, 0), 0)
    end_loc = tl.maximum(key_end - rank + DCP - 1, 0) // DCP  # local keys before key_end
    start_loc = tl.maximum(key_start - rank + DCP - 1, 0) // DCP
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    if QUANT:
        qk_scale = qk_scale * tl.load(scale_ptr + kvh)
        q = _fp16_query(q, UPCAST)
    acc, l_i, m_i = _attend_tiles(
        acc, l_i, m_i, q, q_loc, win_loc, k_cache_ptr, v_cache_ptr,
        bt_ptr + r.to(tl.int64) * stride_bt, kvh * stride_ch, start_loc // TILE_N,
        (end_loc + TILE_N - 1) // TILE_N, end_loc, qk_scale, stride_cb, stride_cs,
        HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, UPCAST, PRECISION, True,
    )  # fmt: skip
    if QUANT:
        acc = acc * tl.load(scale_ptr + tl.num_programs(1) + kvh)
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    tl.store(
        out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        acc / l_safe[:, None],
        mask=io_mask,
    )
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))  # m_i: log2 units
    row_mask = tl.sum(io_mask.to(tl.int32), axis=1) > 0
    tl.store(lse_ptr + tok * tl.num_programs(1) * G + head, lse, mask=row_mask)


def dcp_paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the group's query heads
    kv_cache: torch.Tensor,  # [2, num_blocks, page_tokens, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, whole sequences
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    max_query_len: int,
    rank: int,
    size: int,
    scale: float,
    sliding_window: int | None = None,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [num_tokens, num_heads, head_dim] float32, lse [num_tokens, num_heads]
    float32) over DCP rank ``rank`` of ``size``'s keys; ``attention.dcp.attend_local``'s
    contract (rows past ``query_start_loc[-1]``: output 0, lse -inf)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, page = kv_cache.shape[3], kv_cache.shape[2]
    g = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return out, lse
    query = query.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    quant = is_fp8(kv_cache.dtype)
    if quant and (kv_scale is None or kv_scale.shape != (2, num_kv_heads)):
        raise ValueError("dcp_paged_attention: an fp8 cache needs kv_scale [2, num_kv_heads]")
    scales = {"scale_ptr": kv_scale, "QUANT": True} if quant else {}
    head_pad = max(16, triton.next_power_of_2(head_dim))
    decode = max_query_len <= 1
    cfg = default_tile_config(head_pad, decode, max_query_len, None, kv_cache.element_size())
    block_m = max(cfg.block_m, triton.next_power_of_2(g))
    block_q = block_m // g
    grid = (num_reqs if decode else num_tokens // block_q + num_reqs, num_kv_heads)
    _dcp_kernel[grid](
        out, lse, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, num_reqs,
        rank, float(scale) * LOG2E, int(sliding_window or 0), query.stride(0), query.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), DCP=size, G=g, HEAD_DIM=head_dim,
        HEAD_PAD=head_pad, BLOCK_SIZE=page, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=cfg.tile_n,
        UPCAST=query.device.type == "cpu",
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", DECODE=decode,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **scales,
    )  # fmt: skip
    return out, lse


@triton.jit
def _combine_kernel(
    dst_ptr,  # [D, num_tokens, H, head_dim]
    out_ptr,  # [num_tokens, D * H, head_dim] float32
    lse_ptr,  # [D, num_tokens, D * H] float32: every rank's
    rank,
    num_tokens,
    DCP: tl.constexpr,
    DCP_PAD: tl.constexpr,  # the next power of two
    H: tl.constexpr,  # one rank's query heads
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)  # of the group's D * H
    ranks = tl.arange(0, DCP_PAD)
    lse_all = tl.load(
        lse_ptr + (ranks * num_tokens + t) * (DCP * H) + h, mask=ranks < DCP, other=float("-inf")
    )  # [DCP_PAD]
    top = tl.max(lse_all, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.log(tl.sum(tl.exp(lse_all - top), axis=0)) + top
    own = tl.load(lse_ptr + (rank * num_tokens + t) * (DCP * H) + h)
    w = tl.exp(own - total)
    w = tl.where(w == w, w, 0.0)  # (NaN: rows no rank sees)
    d = tl.arange(0, HEAD_PAD)
    dm = d < HEAD_DIM
    o = tl.load(out_ptr + (t * DCP * H + h) * HEAD_DIM + d, mask=dm, other=0.0)
    dst = dst_ptr + (((h // H) * num_tokens + t) * H + h % H) * HEAD_DIM + d
    tl.store(dst, (o * w).to(dst_ptr.dtype.element_ty), mask=dm)


def dcp_combine(out: torch.Tensor, lse_all: torch.Tensor, rank: int) -> torch.Tensor:
    """``[D, num_tokens, H, head_dim]`` float32: rank ``rank``'s ``out`` [num_tokens, D * H,
    head_dim] weighted by exp(lse - logsumexp over ``lse_all`` [D, num_tokens, D * H]), in
    the layout the reduce-scatter sums."""
    size, n, group_heads = lse_all.shape
    head_dim = out.shape[2]
    assert group_heads % size == 0 and out.shape[:2] == (n, group_heads)
    dst = torch.empty(size, n, group_heads // size, head_dim, dtype=out.dtype, device=out.device)
    if n == 0:
        return dst
    _combine_kernel[(n, group_heads)](
        dst, out.contiguous(), lse_all.contiguous(), rank, n, DCP=size,
        DCP_PAD=triton.next_power_of_2(size), H=group_heads // size, HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return dst
