"""Applying a batch's token bitmask to the logits in one vectorized operation."""

from __future__ import annotations

import torch

# bit j of int32 word w allows token 32 * w + j
_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
) -> None:
    """Set logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (rows None: logits row i).

    logits: [num_rows, vocab] float32; bitmask: [n, ceil(vocab / 32)] int32 on the same
    device; rows: [n] int64, or None. Works on CPU and GPU, no host sync; on a GPU it is
    one Triton kernel (``pagedllm.ops.bitmask``), and the code below is its reference.
    Example: vocab 40, word 0 = 0b101, word 1 = 0 -> only tokens 0 and 2 stay.
    """
    if logits.is_cuda:
        from pagedllm.ops.bitmask import apply_token_bitmask_triton  # Triton only on GPUs

        apply_token_bitmask_triton(logits, bitmask, rows)
        return
    vocab = logits.shape[1]
    if rows is None:
        rows = torch.arange(bitmask.shape[0], device=logits.device)
    shifts = _SHIFTS.to(bitmask.device)  # a no-op: GPU tensors took the kernel above
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [n, words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()  # [n, vocab]
    sub = logits.index_select(0, rows)
    logits.index_copy_(0, rows, sub.masked_fill(~allowed, float("-inf")))
