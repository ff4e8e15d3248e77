"""The one-launch copy between KV-cache blocks and block-major rows (``ops/block_rows.py``)
against its PyTorch reference, both ways: layers of several page sizes (a hybrid model's
window and full layers), bfloat16 and fp8 (bytes) caches, repeated and unordered block ids;
rows of a strided buffer (a range of a producer's transfer buffer); a layout the kernel cannot
take (a page not a multiple of 16 bytes) goes the reference's way with the same result.

On a machine without CUDA the kernel runs through Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import CUDA, DEVICE

# isort: split

import pagedllm.ops.block_rows as mod
from pagedllm.ops.block_rows import copy_block_rows

# (page shapes per tensor, dtype): block size, KV heads, head dim
CASES = {
    "bf16-two-pages": ([(16, 2, 64), (16, 1, 128), (16, 2, 64)], torch.bfloat16),
    "fp8-bytes": ([(16, 2, 32)] * 3, torch.uint8),
    "odd-page": ([(3, 1, 5)] * 2, torch.float16),  # 30 bytes: the reference's way
}


def _tensors(pages: list[tuple], dtype: torch.dtype, num_blocks: int, gen) -> list[torch.Tensor]:
    out = []
    for p in pages:
        x = torch.randint(0, 255, (2, num_blocks, *p), generator=gen, dtype=torch.uint8)
        out.append(x.to(DEVICE) if dtype == torch.uint8 else x.to(dtype).to(DEVICE) / 7)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_gather_and_scatter_match_the_reference(case: str, monkeypatch) -> None:
    pages, dtype = CASES[case]
    used_ref = []
    ref_fn = mod.copy_block_rows_ref
    monkeypatch.setattr(mod, "copy_block_rows_ref",
                        lambda *a, **k: used_ref.append(1) or ref_fn(*a, **k))  # fmt: skip
    gen = torch.Generator().manual_seed(len(case))
    num_blocks, n = (64, 37) if CUDA else (12, 5)
    tensors = _tensors(pages, dtype, num_blocks, gen)
    row_bytes = sum(2 * t[0, 0].numel() * t.element_size() for t in tensors)
    ids = torch.randperm(num_blocks, generator=gen)[:n]
    ids[-1] = ids[0]  # (a block twice: gathering it twice is fine)
    ids = ids.to(DEVICE)
    # rows inside a wider buffer (a range of a transfer buffer): row stride = row bytes
    buf = torch.zeros(n + 4, row_bytes, dtype=torch.uint8, device=DEVICE)
    rows = buf[2 : 2 + n]
    copy_block_rows(tensors, ids, rows, to_rows=True)
    want = torch.empty(n, row_bytes, dtype=torch.uint8, device=DEVICE)
    ref_fn(tensors, ids, want, to_rows=True)
    torch.testing.assert_close(rows, want, rtol=0, atol=0)
    assert not buf[:2].any() and not buf[2 + n :].any()
    # scatter new rows into other blocks (distinct ids: which duplicate wins is unspecified)
    new = torch.randint(0, 255, (n - 1, row_bytes), generator=gen, dtype=torch.uint8).to(DEVICE)
    dst = torch.randperm(num_blocks, generator=gen)[: n - 1].to(DEVICE)
    got = [t.clone() for t in tensors]
    ref = [t.clone() for t in tensors]
    copy_block_rows(got, dst, new, to_rows=False)
    ref_fn(ref, dst, new, to_rows=False)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.view(torch.uint8), r.view(torch.uint8), rtol=0, atol=0)
    assert bool(used_ref) == (case == "odd-page")  # (the kernel ran where it can)
