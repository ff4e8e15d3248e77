"""Triton attention over KV-Compress's per-head paged cache, scoring the keys on the way.

Layout (``pagedllm.kvcompress.cache``): one block holds ``block_size`` consecutive keys of ONE KV
head of ONE layer. Inputs (all on one device):

- ``kv_cache`` [2, num_blocks, block_size, head_dim] (0 = K, 1 = V); slot
  ``s = block_id * block_size + offset``.
- ``block_tables`` [rows, num_kv_heads, max_blocks] int32 and ``seq_lens`` [rows, num_kv_heads]
  (int32 or int64; either may be a strided view): every (row, KV head) has its own table and
  length. Its keys are at logical indices ``0..len-1``; logical index ``i`` sits in block
  ``block_tables[row, head, i // block_size]`` at offset ``i % block_size``.

  Example: block_size 4, block_tables[2, 1] = [7, 3, 9], seq_lens[2, 1] = 10 -> logical
  indices 0-3 are slots 28-31 (block 7), 4-7 slots 12-15 (block 3), 8-9 slots 36-37 (block 9);
  with sliding_window 3 the decode query of that head sees logical 7, 8, 9 = slots 15, 36, 37.
- GQA: query head ``q`` reads KV head ``q // G``, ``G = num_heads // num_kv_heads``.

Modules, one per kernel family:

- :mod:`.decode`: :func:`kvc_decode_attention` (one query token per row, the keys' scores
  updated in the same pass), its single-pass kernel and the rules that pick its launch shape
  and split count;
- :mod:`.decode_split`: the split-K kernels it launches for long contexts at small batch, and
  the persistent kernels that finish a single pass's long heads;
- :mod:`.prefill`: :func:`kvc_paged_attention`, prefill chunks (any query length);
- :mod:`.window_scores`: :func:`kvc_window_scores`, the scores of a prompt's keys from its
  last queries;
- :mod:`.common`: what they share (the launch's checked inputs, one head's keys tile by tile,
  the online softmax and score passes).

Host-side dispatch uses shapes only (no device-to-host sync). These modules import Triton at
import time; under ``TRITON_INTERPRET=1`` the kernels also run on CPU tensors, for tests.
"""

from __future__ import annotations

from pagedllm.ops.kvc_attention.decode import (
    kvc_decode_attention,
    kvc_decode_auto_splits,
    kvc_decode_num_splits,
)
from pagedllm.ops.kvc_attention.prefill import kvc_paged_attention
from pagedllm.ops.kvc_attention.window_scores import kvc_window_scores

__all__ = [
    "kvc_decode_attention",
    "kvc_decode_auto_splits",
    "kvc_decode_num_splits",
    "kvc_paged_attention",
    "kvc_window_scores",
]
