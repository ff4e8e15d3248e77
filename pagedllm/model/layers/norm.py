"""RMSNorm, optionally with Gemma's (1 + weight) scaling."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in float32 and cast back (as HF does).

    ``offset=1.0`` gives Gemma's y = x / rms(x) * (1 + w), with the product taken in float32
    before the cast, matching HF's Gemma3RMSNorm.
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
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + self.weight.float())).to(dtype)
        return self.weight * xf.to(dtype)
