"""The copy between a paged KV cache's blocks and block-major rows (KV transfers, the host
tier), on whichever device the rows are: on a GPU the one-launch Triton kernel
(``ops/block_rows.py``, imported only there, where Triton is), elsewhere the PyTorch
reference (``kv_layout.copy_block_rows_ref``)."""

from __future__ import annotations

import torch

from pagedllm.kv_layout import copy_block_rows_ref


def move_block_rows(
    tensors: list[torch.Tensor],  # each [2, num_blocks, *page]
    ids: torch.Tensor,  # [n] int64 block ids
    rows: torch.Tensor,  # [n, row_bytes] uint8
    to_rows: bool,
) -> None:
    """``rows`` from (``to_rows``) or into the blocks ``ids`` of every tensor."""
    if rows.is_cuda:
        from pagedllm.ops.block_rows import copy_block_rows

        copy_block_rows(tensors, ids, rows, to_rows)
    else:
        copy_block_rows_ref(tensors, ids, rows, to_rows)
