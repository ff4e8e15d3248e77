"""The Triton KV-cache write against its PyTorch reference.

On a machine without CUDA the kernel runs through Triton's interpreter (``TRITON_INTERPRET=1``,
set in triton_setup.py before Triton is imported) on small shapes; the full grid runs only on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import CUDA, DEVICE, cuda_only

# isort: split

from pagedllm.ops.kv_write import write_kv_cache, write_kv_cache_ref

DTYPES = [torch.bfloat16, torch.float16] + ([] if CUDA else [torch.float32])
# (head_dim, num_kv_heads, block_size): small cases everywhere, the rest only on CUDA.
SMALL = [(64, 2, 16), (128, 1, 32), (256, 1, 16), (80, 3, 32)]
BIG = [(hd, kvh, bs) for hd in (64, 128, 256) for kvh in (1, 4, 8) for bs in (16, 32)]
SHAPES = [pytest.param(*s, id=f"d{s[0]}-kvh{s[1]}-bs{s[2]}") for s in SMALL] + [
    pytest.param(*s, id=f"big-d{s[0]}-kvh{s[1]}-bs{s[2]}", marks=cuda_only)
    for s in BIG
    if s not in SMALL
]


def _slots(num_tokens: int, num_blocks: int, block_size: int, pad: int, gen: torch.Generator):
    """Distinct random slots for num_tokens rows, then ``pad`` rows of -1 (CUDA-graph padding)."""
    perm = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    return torch.cat([perm, torch.full((pad,), -1, dtype=torch.int64)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,num_kv_heads,block_size", SHAPES)
def test_write_kv_cache_matches_reference(
    dtype: torch.dtype, head_dim: int, num_kv_heads: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(head_dim * 100 + num_kv_heads * 10 + block_size)
    num_tokens, pad = (37, 5) if CUDA else (11, 3)
    num_blocks = 8
    n = num_tokens + pad
    # K and V as strided slices of one fused [n, q + k + v] projection, as a model produces them.
    fused = torch.randn(n, 3 * num_kv_heads * head_dim, generator=gen).to(dtype)
    kv_size = num_kv_heads * head_dim
    key = fused[:, kv_size : 2 * kv_size].view(n, num_kv_heads, head_dim)
    value = fused[:, 2 * kv_size :].view(n, num_kv_heads, head_dim)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache0 = torch.randn(shape, generator=gen).to(dtype)  # random, so untouched slots show
    slots = _slots(num_tokens, num_blocks, block_size, pad, gen)

    expected = cache0.clone()
    write_kv_cache_ref(key, value, expected, slots)
    got = cache0.to(DEVICE)
    write_kv_cache(key.to(DEVICE), value.to(DEVICE), got, slots.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)


def test_write_kv_cache_casts_to_cache_dtype() -> None:
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(6, 2, 64, generator=gen)
    value = torch.randn(6, 2, 64, generator=gen)
    cache0 = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    slots = torch.tensor([3, 17, -1, 40, 63, -1])
    expected = cache0.clone()
    write_kv_cache_ref(key, value, expected, slots)
    got = cache0.to(DEVICE)
    write_kv_cache(key.to(DEVICE), value.to(DEVICE), got, slots.to(DEVICE))
    # The GPU rounds fp32 -> bf16 to nearest like torch; the CPU interpreter may truncate.
    tol = 0.0 if CUDA else 2.0**-7
    torch.testing.assert_close(got.cpu(), expected, rtol=tol, atol=tol)


def test_write_kv_cache_all_padding_writes_nothing() -> None:
    key = torch.randn(4, 1, 64).to(DEVICE)
    cache = torch.randn(2, 2, 16, 1, 64).to(DEVICE)
    before = cache.clone()
    write_kv_cache(key, key, cache, torch.full((4,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)
