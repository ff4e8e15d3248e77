"""The attention layer as a model sees it: q, k, v in, attended values out."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.dcp import dcp_attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv_layout import calibrate_scales
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Holds one layer's paged KV cache (bound by the model runner after allocation) and
    delegates to the attention backend."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor = torch.empty(0)  # [2, num_blocks, block_size, kvh, d]
        # an fp8 cache's scales [2, kvh] float32 (bound with the cache; None: not fp8), and
        # the checkpoint's k_scale / v_scale, where it has them, that the binding starts from
        self.kv_scale: torch.Tensor | None = None
        self.checkpoint_kv_scale: torch.Tensor | None = None
        self.backend: AttentionBackend | None = None
        # set by the runner's KV-cache layout (pagedllm/kv_layout.py): the layer's index among
        # the model's attention layers and its KV-cache group
        self.layer_idx = 0
        self.kv_group = 0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        positions: torch.Tensor | None = None,
        rotary: RotaryEmbedding | None = None,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """Attend; with ``rotary``, q and k are first rotated by ``positions`` (after the
        per-head ``q_norm``/``k_norm`` when given). On a backend that fuses it (the Triton
        one) the rotation is the kernel that also writes K/V into the cache."""
        # q: [num_tokens, num_heads(, *) head_dim], k/v: [num_tokens, num_kv_heads(, *) head_dim]
        assert self.backend is not None, "attention backend not bound (model runner does it)"
        calibrate = metadata.calibrate_kv_scales and self.kv_scale is not None
        metadata = metadata.for_group(self.kv_group)
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        key: torch.Tensor | None = k
        value: torch.Tensor | None = v
        if calibrate:  # the scales from the K/V as cached (rotated, normed), then written
            assert self.kv_scale is not None
            if rotary is not None:
                assert positions is not None
                q, key = rotary(positions, q, k, q_norm, k_norm)
                rotary = None
            real = metadata.num_actual_tokens  # (rows past it: padding, never cached)
            calibrate_scales(self.kv_scale, key[:real], v[:real])
        if rotary is not None:
            assert positions is not None
            if self.backend.fuses_rope:
                q = rotary.rotate_and_cache(
                    positions, q, k, v, self.kv_cache, metadata.slot_mapping, q_norm, k_norm,
                    self.kv_scale,
                )  # fmt: skip
                key = value = None  # already in the cache
            else:
                q, key = rotary(positions, q, k, q_norm, k_norm)
        if metadata.dcp is not None:  # this rank stores a share of the tokens: attention/dcp.py
            if key is not None:
                assert value is not None
                self.backend.write_kv(
                    key, value, self.kv_cache, metadata.slot_mapping, self.kv_scale
                )
            return dcp_attention(
                q, self.kv_cache, metadata, self.scale, self.sliding_window, self.kv_scale
            )
        return self.backend.forward(
            q, key, value, self.kv_cache, metadata, self.scale, self.sliding_window,
            self.kv_scale,
        )  # fmt: skip
