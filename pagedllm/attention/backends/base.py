"""The attention backend contract."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv_layout import write_kv_ref


class AttentionBackend(ABC):
    """Computes paged attention for one layer over a flattened mixed batch.

    Contract of ``forward``: write the new ``key``/``value`` rows into ``kv_cache`` at
    ``metadata.slot_mapping`` (skipping -1), then for every query row attend over the request's
    cached keys up to and including its own position (causal), restricted to the last
    ``sliding_window`` positions when given, with softmax scale ``scale`` and GQA (query head h
    reads KV head h // (num_heads // num_kv_heads)). Returns [num_tokens, num_heads * head_dim].

    ``kv_cache`` layout: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V).
    An fp8 cache (``torch.float8_e4m3fn``) comes with ``kv_scale`` [2, num_kv_heads] float32:
    K/V are written as fp8(x / scale) and read as fp8 * scale (``pagedllm/kv_layout.py``).

    A backend with ``fuses_rope`` lets the attention layer rotate q/k with the kernel that
    also writes K/V into the cache (:func:`pagedllm.ops.rotary.rope_and_cache`); it then gets
    ``key`` and ``value`` None: this step's rows are already in ``kv_cache``.
    """

    name: str
    fuses_rope: bool = False

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]; None: written
        value: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scale: torch.Tensor | None = None,  # [2, num_kv_heads] float32: fp8 caches only
    ) -> torch.Tensor: ...

    def prefill_variant_query_lens(
        self, head_dim: int, g: int, device: torch.device, itemsize: int, max_len: int
    ) -> list[int]:
        """Longest-row lengths of steps with prompt tokens, one per compiled variant of this
        backend's kernels (the runner runs each once at start-up so that no step stalls for a
        compile); none for a backend that compiles nothing."""
        return []

    # the KV write of ``forward``: (key, value, kv_cache, slot_mapping, kv_scale) -> None
    _kv_write = staticmethod(write_kv_ref)

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64; -1: skip
        kv_scale: torch.Tensor | None = None,
    ) -> None:
        """Only ``forward``'s first half: the rows into the cache (decode context
        parallelism attends on its own, ``attention/dcp.py``)."""
        self._kv_write(key, value, kv_cache, slot_mapping, kv_scale)
