"""Triton gated activations: act(gate) * up for x = [gate | up] in one kernel, where PyTorch
runs two (the activation, then the product) and writes the activation's output in between.

The arithmetic follows PyTorch's (the reference, ``pagedllm.model.layers.activation``): the
activation is computed in float32 and rounded to the input dtype, then multiplied by ``up``
(in float32, rounded once). SiLU is x * sigmoid(x); GELU is the tanh approximation
0.5 x (1 + tanh(u)), computed as x * sigmoid(2u): the same value without the cancellation near
tanh = -1 (Triton's interpreter has no tanh, and PyTorch's tanh differs between its CPU and
GPU libraries anyway, so GELU matches PyTorch within an ulp, not bit for bit).

Input: [num_tokens, 2 * inter] with a contiguous last dim; output: [num_tokens, inter]. The grid
is (num_tokens, ceil(inter / BLOCK)); no host sync, so it is CUDA-graph capturable.

This module imports Triton at import time: import it only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * INTER], row stride stride_x
    y_ptr,  # [num_tokens, INTER] contiguous
    stride_x,
    INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    GELU: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    # Example: INTER 3072, column 5 of token t: gate at x[t, 5], up at x[t, 3072 + 5].
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + INTER + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if GELU:
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) * (...)
        a = g / (1.0 + tl.exp(-2.0 * u))  # 0.5 * g * (1 + tanh(u)) = g * sigmoid(2u)
    else:
        a = g / (1.0 + tl.exp(-g))
    y = a.to(gate.dtype).to(tl.float32) * up.to(tl.float32)
    tl.store(y_ptr + t * INTER + cols, y.to(gate.dtype), mask=mask)


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """act(x[..., :inter]) * x[..., inter:] for a 2-D x whose last dim is 2 * inter;
    ``activation`` is ``"silu"`` or ``"gelu_tanh"``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(
            f"act_and_mul needs a 2-D input with an even, contiguous last dim, got shape "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    tokens, inter = x.shape[0], x.shape[1] // 2
    y = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y
    block = min(_BLOCK, triton.next_power_of_2(inter))
    _act_and_mul_kernel[(tokens, triton.cdiv(inter, block))](
        x, y, x.stride(0), INTER=inter, BLOCK=block, GELU=activation == "gelu_tanh"
    )
    return y
