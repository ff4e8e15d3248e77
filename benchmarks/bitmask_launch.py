"""Host time of applying a grammar bitmask on the GPU, part by part (the engine's
``ModelRunner._apply_bitmask``): the row-index and mask copies to the device (mask from torch
pinned memory, from the grammar worker's shared memory registered with cudaHostRegister, and
from pageable memory) and the Triton kernel's launch. 128 rows, a 49,152-token vocabulary.

    python benchmarks/bitmask_launch.py
"""

from __future__ import annotations

import mmap
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedllm.ops.bitmask import apply_token_bitmask_triton  # noqa: E402
from pagedllm.structured_output.grammars import _register_pinned, _shared_file  # noqa: E402

ROWS, VOCAB, ITERS = 128, 49152, 2000


def per_call_us(fn) -> float:  # noqa: ANN001
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(ITERS):
        fn()
    el = time.perf_counter() - t
    torch.cuda.synchronize()
    return el / ITERS * 1e6


def main() -> None:
    dev = torch.device("cuda")
    words = (VOCAB + 31) // 32
    logits = torch.randn(ROWS, VOCAB, device=dev)
    rows = torch.arange(ROWS, dtype=torch.int64).pin_memory()
    pinned = torch.full((ROWS, words), -1, dtype=torch.int32).pin_memory()
    f = _shared_file(ROWS * words * 4)
    mm = mmap.mmap(f.fileno(), ROWS * words * 4)
    shared = torch.from_numpy(np.ndarray((ROWS, words), dtype=np.int32, buffer=mm))
    registered = _register_pinned(shared)
    pageable = torch.full((ROWS, words), -1, dtype=torch.int32)
    mask_d = pinned.to(dev)
    rows_d = rows.to(dev)
    res = {
        "device": torch.cuda.get_device_name(0),
        "shared_memory_registered": registered,
        "shared_is_pinned": shared.is_pinned(),
        "rows_copy_us": per_call_us(lambda: rows.to(dev, non_blocking=True)),
        "mask_copy_pinned_us": per_call_us(lambda: pinned.to(dev, non_blocking=True)),
        "mask_copy_shared_us": per_call_us(lambda: shared.to(dev, non_blocking=True)),
        "mask_copy_pageable_us": per_call_us(lambda: pageable.to(dev, non_blocking=True)),
        "kernel_launch_us": per_call_us(lambda: apply_token_bitmask_triton(logits, mask_d, rows_d)),
        "rows_numpy_write_us": per_call_us(lambda: rows.numpy().__setitem__(slice(None),
                                                                          np.arange(ROWS))),
    }
    for k, v in res.items():
        print(f"{k:28s} {v:.1f}" if isinstance(v, float) else f"{k:28s} {v}")


if __name__ == "__main__":
    main()
