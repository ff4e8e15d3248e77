"""Llama-family decoders: Llama 2/3, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.model.layers.activation import get_act_and_mul
from pagedllm.model.layers.attention import Attention
from pagedllm.model.layers.embedding import LMHead, VocabEmbedding
from pagedllm.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import get_rope, rope_params
from pagedllm.model.models.base import CausalLM


def layer_window(config: Any, layer_idx: int) -> int | None:
    """The sliding window of a layer, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if not getattr(config, "use_sliding_window", True):
        return None
    return window


class LlamaMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused."""

    def __init__(
        self, hidden: int, intermediate: int, act: str, bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, dtype)
        self.act_fn = get_act_and_mul(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(self(x), residual)``, down_proj's all-reduce fused with the add and norm
        where it can be (slot 1: see ``RowParallelLinear.forward_add_norm``)."""
        return self.down_proj.forward_add_norm(self.act_fn(self.gate_up_proj(x)), residual, norm, 1)


class LlamaAttention(nn.Module):
    """Self-attention with fused qkv, RoPE, optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(
        self, config: Any, layer_idx: int, dtype: torch.dtype, qkv_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // self.num_heads
        o_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, self.num_heads, self.num_kv_heads, qkv_bias or o_bias, dtype
        )
        self.o_proj = RowParallelLinear(self.num_heads * self.head_dim, hidden, o_bias, dtype)
        # this rank's heads (all of them on one rank; see layers/linear.py)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.qk_norm = qk_norm
        theta, scaling = rope_params(config)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, theta, scaling)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5,
            layer_window(config, layer_idx),
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        return self.o_proj(self._attend(positions, x, metadata))

    def forward_add_norm(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        metadata: AttentionMetadata,
        residual: torch.Tensor,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(self(...), residual)``, o_proj's all-reduce fused with the add and norm where
        it can be (slot 0: see ``RowParallelLinear.forward_add_norm``)."""
        return self.o_proj.forward_add_norm(self._attend(positions, x, metadata), residual, norm, 0)

    def _attend(
        self, positions: torch.Tensor, x: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Attention's output before o_proj: [num_tokens, this rank's heads * head_dim]."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        return self.attn(q, k, v, metadata, positions, self.rotary_emb, *norms)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual.

    The residual stream travels beside the normed block inputs: a layer takes (h, residual),
    h already normed by its input norm, and ends with the next layer's input norm (or the
    model's final norm), ``next_norm``, so that each row-parallel layer's all-reduce, the
    residual add and the norm after it are one kernel under TP on GPUs
    (``RowParallelLinear.forward_add_norm``). Worked example, layer i, with h = norm_i(r):
    r = attn(h) + r; h = post_norm(r); r = mlp(h) + r; returns (next_norm(r), r), so r equals
    HF's hidden state after layer i, bit for bit.
    """

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        dtype: torch.dtype,
        qkv_bias: bool,
        qk_norm: bool,
        make_mlp: Callable[[Any, int, torch.dtype], nn.Module],
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, dtype, qkv_bias, qk_norm)
        self.mlp = make_mlp(config, layer_idx, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,
        residual: torch.Tensor,
        metadata: AttentionMetadata,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # h, residual: [num_tokens, hidden]
        h, residual = self.self_attn.forward_add_norm(
            positions, h, metadata, residual, self.post_attention_layernorm
        )
        return self.mlp.forward_add_norm(h, residual, next_norm)


def dense_mlp(config: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    """A layer's dense MLP (its config's intermediate size and activation)."""
    return LlamaMLP(
        config.hidden_size,
        config.intermediate_size,
        config.hidden_act,
        bool(getattr(config, "mlp_bias", False)),
        dtype,
    )


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm; ``make_mlp(config, layer, dtype)``
    builds each layer's MLP (a mixture of experts in the MoE models)."""

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        qkv_bias: bool,
        qk_norm: bool,
        make_mlp: Callable[[Any, int, torch.dtype], nn.Module] = dense_mlp,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype, qkv_bias, qk_norm, make_mlp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if not len(self.layers):
            return self.norm(x)
        # each layer ends with the next one's input norm, the last with the final norm
        h, residual = self.layers[0].input_layernorm(x), x
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, norms):
            h, residual = layer(positions, h, residual, metadata, next_norm)
        return h


class LlamaForCausalLM(CausalLM):
    """Llama 2/3 and Mistral."""

    qkv_bias = False
    qk_norm = False
    make_mlp = staticmethod(dense_mlp)  # each layer's MLP (MoE models: experts)

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, dtype, self.qkv_bias, self.qk_norm, self.make_mlp)
        self.lm_head = LMHead(
            config.vocab_size,
            config.hidden_size,
            dtype,
            tie_to=self.model.embed_tokens if self.tie_word_embeddings else None,
        )


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: Llama with biases on q, k and v."""

    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with RMSNorm on each query and key head before RoPE."""

    qk_norm = True
