"""Copies between a paged KV cache's blocks and block-major rows (the rows of KV transfers and
of the host tier), every layer's cache tensor in one launch.

Row layout (``worker/offload.page_layout``): row i holds block ``ids[i]`` of every cache tensor
back to back, tensor t's K page then its V page from byte offset ``off_t``. Example: two
layers of [16, 8, 128] bfloat16 pages (32 KiB each): row i = [K0 | V0 | K1 | V1] of block
ids[i], 128 KiB; ``off`` = [0, 65536].

The kernel moves 4-byte words, one program per (row, tensor and K/V, chunk of ``BLOCK``
words of the page), and addresses every tensor relative to the first one's pointer (an
argument: 16-byte aligned, and known to be): tensor t starts ``delta_t`` words further
(a multiple of 4), so the compiler can use 16-byte accesses. ``BLOCK`` divides every page,
so a program's chunk is whole or absent (a tensor with a smaller page). Where a condition
does not hold (an address or a page not a multiple of 16 bytes) ``copy_block_rows`` takes
the PyTorch path, ``copy_block_rows_ref`` (in ``pagedllm.kv_layout``: the CPU's path too).

This module imports Triton at import time: import it only where Triton is installed.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedllm.kv_layout import block_pages, copy_block_rows_ref

__all__ = ["copy_block_rows", "copy_block_rows_ref"]

_TABLES: dict[tuple, torch.Tensor] = {}  # (pointers, shapes, device) -> [4, T] int64


@triton.jit
def _block_rows_kernel(
    base_ptr,  # the first cache tensor, as int32 words
    rows_ptr,  # [n, row_words] int32
    ids_ptr,  # [n] int64: each row's block id
    table_ptr,  # [4, T] int64: delta (words from base), K->V stride, page words, row offset
    num_tensors,
    row_words,
    BLOCK: tl.constexpr,
    TO_ROWS: tl.constexpr,  # True: blocks -> rows (gather); False: rows -> blocks (scatter)
):
    i = tl.program_id(0)
    tk = tl.program_id(1)
    c = tl.program_id(2)
    t = tk // 2
    kv = tk % 2
    delta = tl.load(table_ptr + t)
    kv_stride = tl.load(table_ptr + num_tensors + t)
    page = tl.load(table_ptr + 2 * num_tensors + t)
    row_off = tl.load(table_ptr + 3 * num_tensors + t)
    block = tl.load(ids_ptr + i).to(tl.int64)
    # Example: page 4096 words, block 7, K/V stride 64 * 4096, BLOCK 1024, c 2, kv 1: cache
    # words delta + 64 * 4096 + 7 * 4096 + [2048, 3072); row words i * row_words + row_off +
    # 4096 + [2048, 3072).
    cache = tl.multiple_of(delta + kv * kv_stride + block * page + c * BLOCK, 4)
    row = tl.multiple_of(i.to(tl.int64) * row_words + row_off + kv * page + c * BLOCK, 4)
    w = tl.arange(0, BLOCK)
    mask = (w * 0 + c * BLOCK) < page  # (the whole chunk, or none of it)
    if TO_ROWS:
        x = tl.load(base_ptr + cache + w, mask=mask)
        tl.store(rows_ptr + row + w, x, mask=mask)
    else:
        x = tl.load(rows_ptr + row + w, mask=mask)
        tl.store(base_ptr + cache + w, x, mask=mask)


def copy_block_rows(
    tensors: list[torch.Tensor],  # each [2, num_blocks, *page], contiguous
    ids: torch.Tensor,  # [n] int64, on the tensors' device
    rows: torch.Tensor,  # [n, row_bytes] uint8, rows contiguous
    to_rows: bool,
) -> None:
    """``rows`` from (``to_rows``) or into the blocks ``ids`` of every tensor, in one launch
    where the layout allows (see the module docstring), else ``copy_block_rows_ref``."""
    n = rows.shape[0]
    if n == 0 or not tensors:
        return
    pages = block_pages(tensors)
    base = tensors[0].data_ptr()
    ok = (
        all(t.is_contiguous() and (t.data_ptr() - base) % 16 == 0 for t in tensors)
        and all(p % 16 == 0 for p in pages)
        and base % 16 == 0
        and rows.data_ptr() % 16 == 0
        and rows.stride(1) == 1
        and rows.stride(0) % 16 == 0
        and rows.shape[1] == 2 * sum(pages)
    )
    if not ok:
        copy_block_rows_ref(tensors, ids, rows, to_rows)
        return
    words = [p // 4 for p in pages]
    block = math.gcd(*words, 1024)  # a power of two dividing every page (>= 4)
    key = (tuple(t.data_ptr() for t in tensors), tuple(t.shape for t in tensors), rows.device)
    table = _TABLES.get(key)
    if table is None:
        offsets = [0]
        for w in words[:-1]:
            offsets.append(offsets[-1] + 2 * w)
        table = torch.tensor(
            [
                [(t.data_ptr() - base) // 4 for t in tensors],
                [t.stride(0) * t.element_size() // 4 for t in tensors],
                words,
                offsets,
            ],
            dtype=torch.int64,
        ).to(rows.device)
        if len(_TABLES) > 64:
            _TABLES.clear()
        _TABLES[key] = table
    grid = (n, 2 * len(tensors), max(words) // block)
    _block_rows_kernel[grid](
        tensors[0].view(-1).view(torch.int32), rows.view(torch.int32), ids, table,
        len(tensors), rows.stride(0) // 4, BLOCK=block, TO_ROWS=to_rows,
    )  # fmt: skip
