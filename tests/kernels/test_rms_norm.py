"""The Triton RMSNorm against the PyTorch RMSNorm layer (the CPU path and reference).

On a machine without CUDA the kernel runs through Triton's interpreter on small shapes.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import CUDA, DEVICE

# isort: split

from pagedllm.model.layers.norm import RMSNorm
from pagedllm.ops.rms_norm import rms_norm

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _reference(layer: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """The layer's PyTorch arithmetic, on the CPU (where it never dispatches to Triton)."""
    cpu = RMSNorm(x.shape[-1], layer.eps, layer.weight.dtype, layer.offset)
    cpu.weight.data.copy_(layer.weight.detach().cpu())
    return cpu(x.cpu())


def _layer(n: int, dtype: torch.dtype, offset: float, gen: torch.Generator) -> RMSNorm:
    layer = RMSNorm(n, 1e-6, dtype, offset).to(DEVICE)
    layer.weight.data.copy_((torch.randn(n, generator=gen) * 0.5 + (0 if offset else 1)).to(dtype))
    return layer


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    # float32 sums in another order may move a value by one unit in the last place, twice
    # without an offset (rounded after normalizing and after scaling)
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=tol, atol=tol)
    # The same roundings in the same places: nearly every value bit-identical. (float32 moves
    # by an ulp with rstd; Triton's interpreter truncates float32 -> bfloat16 where GPUs and
    # PyTorch round to nearest even, so bfloat16 is held to this only on CUDA.)
    if dtype == torch.float16 or (dtype == torch.bfloat16 and CUDA):
        exact = (got.cpu() == ref).float().mean().item()
        assert exact > 0.97, f"only {exact:.3f} of the values are bit-identical"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [64, 96, 1024] if not CUDA else [64, 96, 1024, 2048, 4096, 5120])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_rms_norm_rows(dtype: torch.dtype, n: int, offset: float) -> None:
    gen = torch.Generator().manual_seed(n)
    layer = _layer(n, dtype, offset, gen)
    x = (torch.randn(13, n, generator=gen) * 3).to(dtype).to(DEVICE)
    got = rms_norm(x, layer.weight, layer.eps, layer.offset)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    _close(got, _reference(layer, x), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("heads,head_dim", [(4, 32), (16, 128), (2, 256)])
def test_rms_norm_heads_of_a_fused_projection(dtype: torch.dtype, heads: int, head_dim: int):
    """Qwen3 / Gemma 3 q and k norms: [tokens, heads, head_dim] views into the qkv output, whose
    token stride is the fused width, not heads x head_dim."""
    gen = torch.Generator().manual_seed(heads * head_dim)
    layer = _layer(head_dim, dtype, 0.0, gen)
    qkv = torch.randn(9, (heads + 2) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, : heads * head_dim].view(9, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + 1) * head_dim].view(9, 1, head_dim)
    assert not q.is_contiguous() and q.stride(0) == (heads + 2) * head_dim
    for view in (q, k):
        got = rms_norm(view, layer.weight, layer.eps)
        _close(got, _reference(layer, view), dtype)


def test_rms_norm_rejects_a_strided_last_dim() -> None:
    x = torch.randn(4, 16, device=DEVICE)[:, ::2]
    with pytest.raises(ValueError, match="contiguous last dim"):
        rms_norm(x, torch.ones(8, device=DEVICE), 1e-6)


def test_rms_norm_empty_batch() -> None:
    x = torch.randn(0, 64, device=DEVICE)
    assert rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)


@pytest.mark.skipif(not CUDA, reason="the layer dispatches to Triton only for CUDA tensors")
def test_layer_dispatches_to_the_kernel_on_cuda() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = _layer(1024, torch.bfloat16, 0.0, gen)
    x = torch.randn(5, 1024, generator=gen).to(torch.bfloat16).to(DEVICE)
    _close(layer(x), _reference(layer, x), torch.bfloat16)
