"""Applying a batch's token bitmask to the logits in one vectorized operation."""

from __future__ import annotations

import functools
from typing import Any

import torch

# bit j of int32 word w allows token 32 * w + j
_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
) -> None:
    """Set logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (rows None: logits row i).

    logits: [num_rows, vocab] float32; bitmask: [n, ceil(vocab / 32)] int32 on the same
    device; rows: [n] int64, or None. No host sync. On a GPU one Triton kernel
    (``pagedllm.ops.bitmask``); on a CPU xgrammar's C++ kernel for float32 logits (structured
    requests need xgrammar anyway, and it is several times the PyTorch version's speed), else
    ``apply_token_bitmask_ref``.
    Example: vocab 40, word 0 = 0b101, word 1 = 0 -> only tokens 0 and 2 stay.
    """
    if logits.is_cuda:
        from pagedllm.ops.bitmask import apply_token_bitmask_triton  # Triton only on GPUs

        apply_token_bitmask_triton(logits, bitmask, rows)
        return
    if logits.dtype == torch.float32 and logits.is_contiguous() and bitmask.is_contiguous():
        xgr = _xgrammar()
        if xgr is not None:
            n = bitmask.shape[0]
            indices = None if n == logits.shape[0] else list(range(n))
            if rows is not None:  # xgrammar's mask row i is logits row i: place the rows
                full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
                full[rows] = bitmask  # (a 32nd of the logits' bytes)
                bitmask, indices = full, rows.tolist()
            xgr.apply_token_bitmask_inplace(
                logits, bitmask, vocab_size=logits.shape[1], indices=indices
            )
            return
    apply_token_bitmask_ref(logits, bitmask, rows)


@functools.cache
def _xgrammar() -> Any:
    """The xgrammar module, or None where it is not installed (looked up once)."""
    try:
        import xgrammar
    except ImportError:
        return None
    return xgrammar


def apply_token_bitmask_ref(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
) -> None:
    """``apply_token_bitmask`` in PyTorch: the reference of both kernels, and the CPU's path
    without xgrammar or for other dtypes."""
    vocab = logits.shape[1]
    if rows is None:
        rows = torch.arange(bitmask.shape[0], device=logits.device)
    shifts = _SHIFTS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [n, words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()  # [n, vocab]
    sub = logits.index_select(0, rows)
    logits.index_copy_(0, rows, sub.masked_fill(~allowed, float("-inf")))
