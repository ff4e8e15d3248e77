"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class SiluAndMul(nn.Module):
    """silu(gate) * up, for x = [gate | up] along the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up (Gemma's gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def get_act_and_mul(name: str) -> nn.Module:
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
        return GeluAndMul()
    raise ValueError(f"unsupported hidden activation {name!r}")
