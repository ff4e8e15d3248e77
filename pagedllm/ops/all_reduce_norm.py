"""All-reduce + residual add + RMSNorm in one Triton kernel, for tensor parallelism on GPUs of
one host (``pagedllm/distributed/parallel_state.py``, ``linear_all_reduce_add_rms_norm``).

A row-parallel layer's matmul writes its partial output into this rank's slot of a
symmetric-memory buffer (every peer maps every rank's slot). Then one kernel, on every rank:
  1. meets the same program of every peer at a barrier (each rank's matmul has finished),
  2. reads row t from every rank's slot and sums them in float32, in rank order (the same sum
     on every rank), rounded to the dtype: the all-reduce's output,
  3. adds the residual (rounded, as PyTorch's add), stores it (the next residual),
  4. stores RMSNorm of it (``pagedllm.ops.rms_norm``'s arithmetic).
Where the unfused path runs the two-shot all-reduce kernel and the add + RMSNorm kernel. With
two ranks the sum is one addition, so every output is bit for bit the unfused path's.

The barrier: rank q's signal pad holds one int32 flag per (program, rank). Program p of rank r
sets flag (p, r) on every peer's pad from 0 to 1 (a compare-and-swap, retried while the flag is
still 1 from the previous call: the peer has not taken it yet), then waits for flag (p, q) of
each peer on its own pad to be 1 and sets it back to 0. The flags return to 0 by themselves, so
the kernel replays from a CUDA graph. Release / acquire at system scope order the matmul's
writes before the peers' reads. The grid is at most ``max_programs`` (the GPU's multiprocessor
count: every program is resident at once, so no program waits on a peer program that cannot
be scheduled); a program takes rows p, p + grid, ...

No barrier at the end: a rank may write the slot again (its next matmul) while a slower peer
still reads it. The caller prevents that by alternating two slots: a slot is written again two
calls later, after this rank passed the barrier of the call in between, which every peer
reaches only once it has finished this call (kernels of one stream run in order).

This module imports Triton at import time: import it only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.ops.rms_norm import _normalize


@triton.jit
def _barrier(pad_ptrs, pid, rank, WORLD: tl.constexpr):
    """Program ``pid`` of every rank meets here (see the module docstring)."""
    for r in tl.static_range(WORLD):
        if r != rank:
            peer = tl.load(pad_ptrs + r).to(tl.pointer_type(tl.int32))
            flag = peer + pid * WORLD + rank
            old = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
            while old != 0:
                old = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
    mine = tl.load(pad_ptrs + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != rank:
            flag = mine + pid * WORLD + r
            old = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys")
            while old != 1:
                old = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys")


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    buf_ptrs,  # [WORLD] int64: each rank's slot, [rows, N] contiguous in y's dtype
    pad_ptrs,  # [WORLD] int64: each rank's signal pad, int32 [max_programs * WORLD]
    r_ptr,  # [rows, N] the residual, row stride stride_r
    w_ptr,  # [N] the norm's weight
    y_ptr,  # [rows, N] contiguous: norm(sum + residual)
    s_ptr,  # [rows, N] contiguous: sum + residual
    rows,
    stride_r,
    rank,
    eps,
    offset,
    N: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= N
    WORLD: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
):
    pid = tl.program_id(0)
    _barrier(pad_ptrs, pid, rank, WORLD)
    dtype = y_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    for t in range(pid, rows, tl.num_programs(0)):
        row = t * N  # int32: a slot holds fewer than 2**31 elements
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            src = tl.load(buf_ptrs + r).to(tl.pointer_type(dtype))
            acc += tl.load(src + row + cols, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(dtype)  # the all-reduce's output
        res = tl.load(r_ptr + t * stride_r + cols, mask=mask, other=0.0)
        s = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)  # PyTorch's add: rounded once
        tl.store(s_ptr + row + cols, s, mask=mask)
        y = _normalize(s, w_ptr, cols, mask, eps, offset, N, HAS_OFFSET)
        tl.store(y_ptr + row + cols, y.to(dtype), mask=mask)


def all_reduce_add_rms_norm(
    buf_ptrs: torch.Tensor,
    pad_ptrs: torch.Tensor,
    rank: int,
    rows: int,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    max_programs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum + residual), sum + residual), the sum over the ranks of each rank's slot
    (``buf_ptrs[r]``: [rows, hidden] contiguous, residual's dtype). Every rank must call it
    with the same ``rows`` and ``max_programs`` (the barrier pairs program p of every rank);
    ``pad_ptrs``' pads hold at least ``max_programs * world`` int32 flags, all 0 at first."""
    if residual.dim() != 2 or residual.stride(-1) != 1 or residual.shape[0] != rows:
        raise ValueError(
            f"all_reduce_add_rms_norm needs a [{rows}, hidden] residual with a contiguous "
            f"last dim, got {tuple(residual.shape)} strides {residual.stride()}"
        )
    n = residual.shape[1]
    y = torch.empty((rows, n), dtype=residual.dtype, device=residual.device)
    s = torch.empty((rows, n), dtype=residual.dtype, device=residual.device)
    if rows == 0:  # (on every rank alike: the rows are the same)
        return y, s
    block = triton.next_power_of_2(n)
    _all_reduce_add_rms_norm_kernel[(min(rows, max_programs),)](
        buf_ptrs,
        pad_ptrs,
        residual,
        weight,
        y,
        s,
        rows,
        residual.stride(0),
        rank,
        eps,
        offset,
        N=n,
        BLOCK=block,
        WORLD=buf_ptrs.numel(),
        HAS_OFFSET=bool(offset),
        num_warps=8 if block >= 4096 else 4,
    )
    return y, s


def all_reduce_add_rms_norm_ref(
    parts: list[torch.Tensor],
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch reference: every rank's part summed in float32 in rank order and rounded,
    then ``RMSNorm.forward(sum, residual)``'s arithmetic (the unfused path's): (y, s)."""
    total = parts[0].float()
    for p in parts[1:]:
        total = total + p.float()
    s = (total.to(residual.dtype).float() + residual.float()).to(residual.dtype)
    xf = s.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (offset + weight.float())).to(s.dtype), s
    return weight * xf.to(s.dtype), s
