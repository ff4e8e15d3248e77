"""Triton kernel that applies a batch's grammar token bitmask to the logits in place: one
launch, reading the packed int32 words and writing -inf only where a token is not allowed
(the PyTorch version in ``pagedllm.structured_output.bitmask`` unpacks the bits into a
[rows, vocab] tensor and rewrites whole rows: ~10 kernels and ~10 passes over the logits).

Bit j of word w of a mask row allows token 32 * w + j (xgrammar's layout).
Example: vocab 40, words [0b101, 0] -> only tokens 0 and 2 keep their logits.

Grid: (len(rows), ceil(vocab / BLOCK)); no host sync, so it needs nothing from the host but
the mask and the row indices (both copied without blocking).

This module imports Triton at import time: import it only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,  # [num_rows, vocab] float, row stride stride_l
    mask_ptr,  # [n, words] int32 contiguous
    rows_ptr,  # [n] int64: the logits row of mask row i (unused without HAS_ROWS)
    stride_l,
    vocab,
    words,
    BLOCK: tl.constexpr,
    HAS_ROWS: tl.constexpr,  # False: mask row i is logits row i
):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    if HAS_ROWS:
        row = tl.load(rows_ptr + i)
    else:
        row = i
    # Example: token 37 -> word 1, bit 5.
    word = tl.load(mask_ptr + i * words + cols // 32, mask=in_vocab, other=0)
    allowed = ((word >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + cols, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None
) -> None:
    """logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (rows None: row i); same
    contract as ``pagedllm.structured_output.bitmask.apply_token_bitmask``."""
    n, words = bitmask.shape
    vocab = logits.shape[1]
    if words * 32 < vocab:
        raise ValueError(f"bitmask covers {words * 32} tokens, the logits have {vocab}")
    ok_rows = rows.shape == (n,) if rows is not None else n <= logits.shape[0]
    if logits.stride(1) != 1 or not bitmask.is_contiguous() or not ok_rows:
        raise ValueError(
            "apply_token_bitmask needs contiguous logit rows, a contiguous mask "
            "and one row index per mask row"
        )
    if n == 0:
        return
    _apply_bitmask_kernel[(n, triton.cdiv(vocab, _BLOCK))](
        logits,
        bitmask,
        bitmask if rows is None else rows,  # any pointer: not read without rows
        logits.stride(0),
        vocab,
        words,
        BLOCK=_BLOCK,
        HAS_ROWS=rows is not None,
    )
