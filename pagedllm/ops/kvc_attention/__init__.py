"""Triton attention over KV-Compress's per-head paged cache (decode, prefill chunks, the
prompt's window scores); see :mod:`.decode`'s docstring for the cache layout."""

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
