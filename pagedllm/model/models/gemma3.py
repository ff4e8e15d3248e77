"""Gemma 3 (text): sliding-window layers interleaved with global ones, per-layer RoPE base,
(1 + w) RMSNorms around both blocks, query_pre_attn_scalar, scaled and tied embeddings."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.model.layers.attention import Attention
from pagedllm.model.layers.embedding import LMHead, VocabEmbedding
from pagedllm.model.layers.linear import QKVParallelLinear, RowParallelLinear
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import get_rope, rope_params
from pagedllm.model.models.base import CausalLM
from pagedllm.model.models.llama import LlamaMLP, layer_window


def _layer_rope(config: Any, layer_idx: int) -> tuple[float, dict | None]:
    layer_types = getattr(config, "layer_types", None) or []
    kind = layer_types[layer_idx] if layer_idx < len(layer_types) else "full_attention"
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and kind in params:
        return rope_params(config, kind)
    if kind == "sliding_attention":  # transformers 4.x names
        return float(getattr(config, "rope_local_base_freq", 10000.0)), None
    return rope_params(config)


class Gemma3Attention(nn.Module):
    """Attention with per-head (1 + w) RMSNorm on q and k and scale query_pre_attn_scalar^-0.5."""

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias, dtype
        )
        self.o_proj = RowParallelLinear(
            self.num_heads * self.head_dim, config.hidden_size, bias, dtype
        )
        # this rank's heads (all of them on one rank; see layers/linear.py)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, offset=1.0)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, offset=1.0)
        theta, scaling = _layer_rope(config, layer_idx)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            float(config.query_pre_attn_scalar) ** -0.5,
            layer_window(config, layer_idx),
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, metadata, positions, self.rotary_emb, self.q_norm, self.k_norm)
        return self.o_proj(out)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: norm -> attn -> norm -> +residual; norm -> mlp -> norm -> +residual."""

    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        eps, h = config.rms_norm_eps, config.hidden_size
        self.self_attn = Gemma3Attention(config, layer_idx, dtype)
        self.mlp = LlamaMLP(h, config.intermediate_size, config.hidden_activation, False, dtype)
        self.input_layernorm = RMSNorm(h, eps, dtype, offset=1.0)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, dtype, offset=1.0)
        self.post_feedforward_layernorm = RMSNorm(h, eps, dtype, offset=1.0)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        h = self.self_attn(positions, self.input_layernorm(x), metadata)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3Model(nn.Module):
    """Scaled embeddings, layers, final (1 + w) norm."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, offset=1.0)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # HF multiplies by the scale rounded to the weights' dtype.
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        for layer in self.layers:
            x = layer(positions, x, metadata)
        return self.norm(x)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text model (1B and smaller are text-only checkpoints)."""

    norm_offset = 1.0

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError("attn_logit_softcapping is not supported")
        self.model = Gemma3Model(config, dtype)
        self.lm_head = LMHead(
            config.vocab_size,
            config.hidden_size,
            dtype,
            tie_to=self.model.embed_tokens if self.tie_word_embeddings else None,
        )
