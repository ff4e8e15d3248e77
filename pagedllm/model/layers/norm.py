"""RMSNorm, optionally with Gemma's (1 + weight) scaling."""

from __future__ import annotations

import torch
from torch import nn

_TRITON_RMS_NORM = None


def _triton_rms_norm():  # noqa: ANN202
    """pagedllm.ops.rms_norm.rms_norm, imported on first use (Triton is needed only on GPUs)."""
    global _TRITON_RMS_NORM
    if _TRITON_RMS_NORM is None:
        from pagedllm.ops.rms_norm import rms_norm

        _TRITON_RMS_NORM = rms_norm
    return _TRITON_RMS_NORM


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in float32 and cast back (as HF does).

    ``offset=1.0`` gives Gemma's y = x / rms(x) * (1 + w), with the product taken in float32
    before the cast, matching HF's Gemma3RMSNorm.

    On a GPU the same arithmetic runs as one Triton kernel (``pagedllm.ops.rms_norm``) instead
    of seven PyTorch ones; the code below is its reference (and the CPU path).
    """

    def __init__(
        self, hidden_size: int, eps: float, dtype: torch.dtype, offset: float = 0.0
    ) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        init = torch.zeros if offset else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dim() in (2, 3) and x.stride(-1) == 1:
            return _triton_rms_norm()(x, self.weight, self.eps, self.offset)
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)
