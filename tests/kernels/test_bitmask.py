"""The grammar-bitmask kernels (Triton; xgrammar's on the CPU) against the PyTorch reference.

On a machine without CUDA the kernel runs through Triton's interpreter on small shapes.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import CUDA, DEVICE

# isort: split

from pagedllm.ops.bitmask import apply_token_bitmask_triton
from pagedllm.structured_output.bitmask import apply_token_bitmask, apply_token_bitmask_ref


@pytest.mark.parametrize("vocab", [40, 1000, 5000] if not CUDA else [40, 5000, 151936])
@pytest.mark.parametrize("allowed_frac", [0.0, 0.01, 0.5, 1.0])
def test_bitmask_equals_the_reference(vocab: int, allowed_frac: float) -> None:
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    logits = torch.randn(7, vocab, generator=gen)
    allowed = torch.rand(3, words * 32, generator=gen) < allowed_frac
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    packed = (allowed.view(3, words, 32).long() * weights).sum(-1)
    mask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # as int32
    rows = torch.tensor([5, 0, 3])
    ref = logits.clone()
    apply_token_bitmask_ref(ref, mask, rows)
    cpu = logits.clone()
    apply_token_bitmask(cpu, mask, rows)  # CPU tensors: xgrammar's kernel
    assert torch.equal(cpu, ref)
    got = logits.to(DEVICE)
    apply_token_bitmask_triton(got, mask.to(DEVICE), rows.to(DEVICE))
    assert torch.equal(got.cpu(), ref)
    # untouched rows stay as they were; masked ones are -inf exactly where a bit is 0
    for i, r in enumerate(rows.tolist()):
        keep = allowed[i, :vocab]
        assert torch.equal(ref[r][keep], logits[r][keep])
        assert bool(torch.isneginf(ref[r][~keep]).all())
    assert torch.equal(got.cpu()[[1, 2, 4, 6]], logits[[1, 2, 4, 6]])
    # without row indices mask row i applies to logits row i
    ref2, got2 = logits.clone(), logits.to(DEVICE)
    apply_token_bitmask_ref(ref2, mask, None)
    apply_token_bitmask_triton(got2, mask.to(DEVICE), None)
    cpu2 = logits.clone()
    apply_token_bitmask(cpu2, mask, None)
    apply_token_bitmask_ref(logits, mask, torch.arange(3))  # the same, spelled out
    assert torch.equal(got2.cpu(), ref2) and torch.equal(ref2, logits) and torch.equal(cpu2, ref2)


def test_bitmask_rejects_a_short_mask() -> None:
    logits = torch.zeros(2, 100, device=DEVICE)
    with pytest.raises(ValueError, match="covers 96 tokens"):
        apply_token_bitmask_triton(
            logits,
            torch.zeros(1, 3, dtype=torch.int32, device=DEVICE),
            torch.zeros(1, dtype=torch.long, device=DEVICE),
        )
