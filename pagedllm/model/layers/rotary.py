"""Rotary position embeddings (neox layout: rotate the two halves of each head)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.norm import RMSNorm
from pagedllm.ops import cpu as cpu_ops


def rope_params(config: Any, layer_type: str | None = None) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from an HF config, old (rope_theta / rope_scaling) or new
    (transformers 5 ``rope_parameters``, possibly keyed by layer type) style."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if layer_type is not None and layer_type in params:
            params = params[layer_type]
        elif "full_attention" in params and "rope_theta" not in params:
            params = params["full_attention"]
        theta = float(params.get("rope_theta", 10000.0))
        scaling = None if params.get("rope_type", "default") == "default" else dict(params)
        return theta, scaling
    theta = float(getattr(config, "rope_theta", 10000.0))
    scaling = getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given each token's position. The cos/sin table is built once
    for ``max_position`` positions."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], -1), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k by their tokens' positions; with ``q_norm``/``k_norm`` (per-head
        RMSNorms, Qwen3 and Gemma 3) normalize each head first. On a GPU all of it is one
        Triton kernel (``pagedllm.ops.rotary``); on a CPU the rotation is one compiled kernel
        per tensor (``pagedllm.ops.cpu.rope``: the same operations in the same order, float32
        bit for bit). The code below is their reference."""
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
        if q.is_cuda and q.stride(-1) == 1 and k.stride(-1) == 1:
            from pagedllm.ops.rotary import rope  # Triton is needed only on GPUs

            return rope(positions, q, k, self.cos_sin, *_norm_args(q_norm, k_norm))
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        rq = cpu_ops.rope(q, positions, self.cos_sin)  # on a CPU: compiled
        rk = cpu_ops.rope(k, positions, self.cos_sin) if rq is not None else None
        if rq is not None and rk is not None:
            return rq, rk
        cos, sin = self.cos_sin.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_and_cache(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        kv_scale: torch.Tensor | None = None,  # [2, num_kv_heads]: an fp8 cache's scales
    ) -> torch.Tensor:
        """GPU only: :meth:`forward` with the rotated K and V written into ``kv_cache`` at
        ``slot_mapping`` in the same Triton kernel; returns the rotated q."""
        from pagedllm.ops.rotary import rope_and_cache

        norm_args = _norm_args(q_norm, k_norm)
        return rope_and_cache(
            positions, q, k, v, self.cos_sin, kv_cache, slot_mapping, *norm_args,
            kv_scale=kv_scale,
        )  # fmt: skip


def _norm_args(q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> tuple:
    """The rope kernels' trailing arguments for per-head norms: (q weight, k weight, eps,
    offset), or () without them (one eps and offset serve both: they must agree)."""
    if q_norm is None or k_norm is None:
        return ()
    assert q_norm.eps == k_norm.eps and q_norm.offset == k_norm.offset
    return (q_norm.weight, k_norm.weight, q_norm.eps, q_norm.offset)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None
) -> RotaryEmbedding:
    """A shared RotaryEmbedding: every layer with the same parameters (on the same default
    device) uses one cos/sin table instead of one per layer (64 MiB each at 128k positions)."""
    device = torch.get_default_device()
    key = (head_dim, max_position, theta, repr(sorted((scaling or {}).items())), str(device))
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = _ROPE_CACHE[key] = RotaryEmbedding(head_dim, max_position, theta, scaling)
    return rope
