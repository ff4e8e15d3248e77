"""The fused all-reduce + residual add + RMSNorm kernel (``pagedllm/ops/all_reduce_norm.py``)
against its PyTorch reference, in one process: the "ranks'" slots are tensors of this device
and the peers' barrier flags are set beforehand, as if every peer had arrived. The test of the
kernel across two GPUs, through symmetric memory and from CUDA graphs, is in
``tests/models/test_custom_all_reduce.py``.

On a machine without CUDA the kernel runs through Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import CUDA, DEVICE

# isort: split

from pagedllm.ops.all_reduce_norm import all_reduce_add_rms_norm, all_reduce_add_rms_norm_ref


def _ptrs(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (4, 2)])
@pytest.mark.parametrize("rows,hidden,programs", [(5, 48, 3), (1, 64, 4), (9, 96, 9)])
def test_matches_reference(
    dtype: torch.dtype, world: int, rank: int, rows: int, hidden: int, programs: int
) -> None:
    gen = torch.Generator().manual_seed(rows * world + rank)
    parts = [(torch.randn(rows, hidden, generator=gen) * 2).to(dtype).to(DEVICE)
             for _ in range(world)]  # fmt: skip
    # a residual with a row stride wider than the row (a view)
    wide = torch.randn(rows, hidden + 8, generator=gen).to(dtype).to(DEVICE)
    residual = wide[:, :hidden]
    weight = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(dtype).to(DEVICE)
    pads = [torch.zeros(programs, world, dtype=torch.int32, device=DEVICE) for _ in range(world)]
    for r in range(world):
        if r != rank:
            pads[rank][:, r] = 1  # peer r's program p has arrived
    y, s = all_reduce_add_rms_norm(
        _ptrs(parts), _ptrs(pads), rank, rows, residual, weight, 1e-6, 0.0, programs
    )
    want_y, want_s = all_reduce_add_rms_norm_ref(
        [p.cpu() for p in parts], residual.cpu(), weight.cpu(), 1e-6
    )
    # the sum: the same float32 additions in rank order, rounded once (the interpreter
    # truncates float32 -> bfloat16 where GPUs round to nearest even: one bf16 ulp there)
    tol = 0 if dtype == torch.float32 or CUDA else 2e-2
    torch.testing.assert_close(s.cpu().float(), want_s.float(), rtol=tol, atol=tol)
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(y.cpu().float(), want_y.float(), rtol=tol, atol=tol)
    # every flag the kernel took is back to 0, and each peer got one arrival per program
    used = min(rows, programs)
    for r in range(world):
        want = torch.zeros(programs, world, dtype=torch.int32)
        if r != rank:
            want[:used, rank] = 1
        else:
            for q in range(world):
                if q != rank:
                    want[used:, q] = 1  # programs that did not run leave theirs
        assert torch.equal(pads[r].cpu(), want), f"pad of rank {r}"


def test_rejects_a_residual_of_other_rows() -> None:
    x = torch.zeros(4, 16, device=DEVICE)
    ptrs = _ptrs([x, x])
    with pytest.raises(ValueError, match="residual"):
        all_reduce_add_rms_norm(ptrs, ptrs, 0, 3, x, torch.ones(16, device=DEVICE), 1e-6, 0.0, 4)
