"""Triton RMSNorm: one kernel where PyTorch runs seven (float cast, square, mean, add eps,
rsqrt, multiply, cast and scale), over rows of any stride.

The arithmetic follows HF (and ``pagedllm.model.layers.norm.RMSNorm``, the reference): the sum
of squares and the scaling are in float32; without an offset the normalized row is rounded to
the input dtype before it is multiplied by the weight (Llama, Qwen); with ``offset`` (Gemma's
1 + w) the product is taken in float32 and rounded once.

Input: [num_rows, hidden] or [num_tokens, num_heads, head_dim] (q/k norms of Qwen3 and Gemma 3,
views into the fused qkv projection); the last dimension must be contiguous. Output: a new
contiguous tensor of the same shape. One program per (token, head) row; no host sync, so it is
CUDA-graph capturable.

``fused_add_rms_norm`` is the pre-norm of a residual block: s = x + residual (rounded to the
dtype, as PyTorch's add does), y = norm(s); one kernel returns both (Llama and Qwen keep ``s``
as the next residual), where PyTorch runs an add and the seven norm kernels.

This module imports Triton at import time: import it only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normalize(x, w_ptr, cols, mask, eps, offset, N: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """One row x (the input dtype) / rms(x) * w, or * (offset + w) with an offset, in float32;
    without an offset the normalized row is first rounded to x's dtype (HF's order)."""
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        return xf * rstd * (offset + w)
    return (xf * rstd).to(x.dtype).to(tl.float32) * w  # float casts round to nearest even


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    stride_xt,  # input stride between tokens
    stride_xh,  # input stride between heads (0 for a 2-D input)
    num_heads,
    eps,
    offset,
    N: tl.constexpr,  # the normalized size (hidden or head_dim)
    BLOCK: tl.constexpr,  # next power of two >= N
    HAS_OFFSET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    y = _normalize(x, w_ptr, cols, mask, eps, offset, N, HAS_OFFSET)
    # output row r = t * num_heads + h, contiguous
    tl.store(y_ptr + (t * num_heads + h) * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """y = x / rms(x) * w (``offset`` 0) or x / rms(x) * (offset + w), over the last dim."""
    if x.stride(-1) != 1 or x.dim() not in (2, 3):
        raise ValueError(
            f"rms_norm needs a 2-D or 3-D input with a contiguous last dim, got "
            f"shape {tuple(x.shape)} strides {x.stride()}"
        )
    n = x.shape[-1]
    tokens = x.shape[0]
    heads = x.shape[1] if x.dim() == 3 else 1
    stride_h = x.stride(1) if x.dim() == 3 else 0
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y
    _rms_norm_kernel[(tokens, heads)](
        x,
        weight,
        y,
        x.stride(0),
        stride_h,
        heads,
        eps,
        offset,
        N=n,
        BLOCK=triton.next_power_of_2(n),
        HAS_OFFSET=bool(offset),
    )
    return y


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [num_rows, N], row stride stride_x
    r_ptr,  # [num_rows, N], row stride stride_r
    w_ptr,  # [N]
    y_ptr,  # [num_rows, N] contiguous: norm(x + r)
    s_ptr,  # [num_rows, N] contiguous: x + r
    stride_x,
    stride_r,
    eps,
    offset,
    N: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= N
    HAS_OFFSET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
    r = tl.load(r_ptr + t * stride_r + cols, mask=mask, other=0.0)
    s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # PyTorch's add: rounded once
    tl.store(s_ptr + t * N + cols, s, mask=mask)
    y = _normalize(s, w_ptr, cols, mask, eps, offset, N, HAS_OFFSET)
    tl.store(y_ptr + t * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) for 2-D [num_rows, hidden] inputs of one dtype."""
    if x.dim() != 2 or x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"fused_add_rms_norm needs two 2-D inputs of one shape and dtype, got "
            f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}"
        )
    if x.stride(-1) != 1 or residual.stride(-1) != 1:
        raise ValueError("fused_add_rms_norm needs inputs with a contiguous last dim")
    rows, n = x.shape
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    s = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y, s
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows,)](
        x,
        residual,
        weight,
        y,
        s,
        x.stride(0),
        residual.stride(0),
        eps,
        offset,
        N=n,
        BLOCK=block,
        HAS_OFFSET=bool(offset),
        num_warps=8 if block >= 4096 else 4,
    )
    return y, s
