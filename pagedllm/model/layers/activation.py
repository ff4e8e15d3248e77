"""Gated activations over a fused [gate | up] projection.

On a GPU each runs as one Triton kernel (``pagedllm.ops.activation``); the PyTorch code here is
its reference and the CPU path (on a CPU, silu-and-mul is one compiled pass of
``pagedllm.ops.cpu`` where the kernels are built, in float32 and bfloat16).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dim() == 2 and x.stride(-1) == 1


def _triton_act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    from pagedllm.ops.activation import act_and_mul  # Triton is needed only on GPUs

    return act_and_mul(x, activation)


class SiluAndMul(nn.Module):
    """silu(gate) * up, for x = [gate | up] along the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _on_gpu(x):
            return _triton_act_and_mul(x, "silu")
        if x.device.type == "cpu":  # one compiled pass (pagedllm/ops/cpu) where built
            from pagedllm.ops.cpu import silu_and_mul

            out = silu_and_mul(x)
            if out is not None:
                return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up (Gemma's gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _on_gpu(x):
            return _triton_act_and_mul(x, "gelu_tanh")
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def get_act_and_mul(name: str) -> nn.Module:
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):
        return GeluAndMul()
    raise ValueError(f"unsupported hidden activation {name!r}")
