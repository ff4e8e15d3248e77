"""RMSNorm, optionally with Gemma's (1 + weight) scaling."""

from __future__ import annotations

from types import ModuleType
from typing import overload

import torch
from torch import nn

from pagedllm.ops import cpu as cpu_ops

_TRITON_OPS: ModuleType | None = None


def _triton_ops() -> ModuleType:
    """pagedllm.ops.rms_norm, imported on first use (Triton is needed only on GPUs)."""
    global _TRITON_OPS
    if _TRITON_OPS is None:
        from pagedllm.ops import rms_norm

        _TRITON_OPS = rms_norm
    return _TRITON_OPS


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in float32 and cast back (as HF does).

    ``offset=1.0`` gives Gemma's y = x / rms(x) * (1 + w), with the product taken in float32
    before the cast, matching HF's Gemma3RMSNorm.

    ``forward(x, residual)`` is a residual block's pre-norm: it returns (norm(x + residual),
    x + residual), the sum rounded to the dtype as a plain add would, so the result is the
    same as adding first.

    On a GPU the same arithmetic runs as one Triton kernel (``pagedllm.ops.rms_norm``) instead
    of seven (eight with the add) PyTorch ones; on a CPU, as one compiled kernel
    (``pagedllm.ops.cpu.rms_norm``: in bfloat16 the same roundings, in float32 the same
    arithmetic with the sum of squares in another order) when the CPU kernels are built.
    The code below is their reference (and the path with ``PAGEDLLM_FLOAT32_EXACT=1``).
    """

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, offset: float = 0.0
    ) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype), requires_grad=False)

    @overload
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and residual.stride(-1) == 1:
                return _triton_ops().fused_add_rms_norm(
                    x, residual, self.weight, self.eps, self.offset
                )
            if not x.is_cuda:  # bfloat16 on a CPU: one compiled kernel (ops/cpu)
                out = cpu_ops.rms_norm(x, self.weight, self.eps, self.offset, residual)
                if out is not None:
                    return out
            s = x + residual
            return self.forward(s), s
        if x.is_cuda and x.dim() in (2, 3) and x.stride(-1) == 1:
            return _triton_ops().rms_norm(x, self.weight, self.eps, self.offset)
        if not x.is_cuda:
            out = cpu_ops.rms_norm(x, self.weight, self.eps, self.offset)
            if out is not None:
                return out
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)
