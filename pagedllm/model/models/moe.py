"""Mixture-of-experts decoders on the Llama family's attention: Qwen3-MoE, Qwen2-MoE (with a
shared expert) and Mixtral.

Each model differs from its dense sibling only in its MLP (``layers/moe.py``): a router over
``E`` experts and the top-k experts' weighted outputs. Checkpoints keep one tensor per expert
and projection (``mlp.experts.<e>.gate_proj.weight`` in Qwen3-MoE, ``block_sparse_moe.
experts.<e>.w1.weight`` in Mixtral; w1 gate, w3 up, w2 down), which ``load_special`` places
into the stacked ``w13`` / ``w2``; a checkpoint already stacked (``experts.gate_up_proj``,
``experts.down_proj``, as transformers 5 holds them in memory) loads as it is.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.model.layers.moe import SparseMoeBlock, moe_forward_context
from pagedllm.model.models.llama import (
    LlamaForCausalLM,
    LlamaMLP,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    dense_mlp,
)

# (prefix, expert, projection) of one expert's tensor; projection names of both families
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_SHARD = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
# transformers 5's stacked names: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
_STACKED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class MoEWeights:
    """What the MoE model classes add to their dense siblings (a mixin): ``load_special``
    for expert tensors, the padding-row mask of the expert-load counts, the counts, and the
    data-parallel exchange of a core with nothing to compute."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """The dense model's forward pass, its rows' validity known to the MoE layers (a CUDA
        graph's padding rows have slot -1)."""
        slots = metadata.slot_mapping
        valid = None
        if slots is not None and slots.dim() == 1 and slots.shape[0] == input_ids.shape[0]:
            valid = slots >= 0
        with moe_forward_context(valid):
            return super().forward(input_ids, positions, metadata)  # type: ignore[misc]

    def moe_blocks(self) -> list[SparseMoeBlock]:
        modules = self.modules()  # type: ignore[attr-defined]
        return [m for m in modules if isinstance(m, SparseMoeBlock)]

    def take_expert_load(self) -> torch.Tensor:
        """The (token, expert) pairs each expert computed here since the last call, per MoE
        layer: ``[num_moe_layers, E]`` on the device (other ranks' experts: zeros)."""
        return torch.stack([b.experts.take_load() for b in self.moe_blocks()])

    def dp_idle_forward(self) -> None:
        """A core with no tokens this step: each MoE layer's exchange with zero rows of its
        own, in layer order (the other cores' rows still reach its experts)."""
        for block in self.moe_blocks():
            w13 = block.experts.w13  # [E_local, 2I, H]
            block(torch.empty(0, w13.shape[2], dtype=w13.dtype, device=w13.device))

    def load_special(
        self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> str | None:
        m = _EXPERT.fullmatch(name)
        if m is not None:
            prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            shard = _SHARD[proj]
            target = f"{prefix}.{'w2' if shard == 2 else 'w13'}"
            param = self._param(params, target, name)
            param.weight_loader(param, tensor, (expert, shard))  # type: ignore[attr-defined]
            return target
        m = _STACKED.fullmatch(name)
        if m is not None:
            prefix, which = m.groups()
            if which == "down_proj":
                param = self._param(params, f"{prefix}.w2", name)
                param.weight_loader(param, tensor, (None, 2))  # type: ignore[attr-defined]
                return f"{prefix}.w2"
            param = self._param(params, f"{prefix}.w13", name)
            gate, up = tensor.chunk(2, dim=-2)
            param.weight_loader(param, gate, (None, 0))  # type: ignore[attr-defined]
            param.weight_loader(param, up, (None, 1))  # type: ignore[attr-defined]
            return f"{prefix}.w13"
        return None

    @staticmethod
    def _param(params: dict[str, nn.Parameter], target: str, name: str) -> nn.Parameter:
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no parameter")
        return params[target]


def _qwen_moe_mlp(config: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    """Experts on the layers HF's Qwen-MoE models give them (every ``decoder_sparse_step``-th,
    not in ``mlp_only_layers``), a dense MLP on the others; a shared expert where the config
    sizes one (Qwen2-MoE)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    sparse = (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % step == 0
    )
    if not sparse:
        return dense_mlp(config, layer_idx, dtype)
    shared = None
    if getattr(config, "shared_expert_intermediate_size", 0):
        shared = LlamaMLP(config.hidden_size, config.shared_expert_intermediate_size,
                          config.hidden_act, False, dtype)  # fmt: skip
    return SparseMoeBlock(
        config.hidden_size, config.num_experts, config.num_experts_per_tok,
        config.moe_intermediate_size, bool(config.norm_topk_prob), config.hidden_act, dtype,
        shared,
    )  # fmt: skip


def _mixtral_mlp(config: Any, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    """Experts on every layer; the top-k weights always renormalized."""
    return SparseMoeBlock(
        config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
        config.intermediate_size, True, config.hidden_act, dtype,
    )  # fmt: skip


class Qwen3MoeForCausalLM(MoEWeights, Qwen3ForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B: 48 layers, 128 experts, top-8): Qwen3's attention, experts
    in the MLPs."""

    make_mlp = staticmethod(_qwen_moe_mlp)


class Qwen2MoeForCausalLM(MoEWeights, Qwen2ForCausalLM):
    """Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases),
    experts plus a gated shared expert in the MLPs."""

    make_mlp = staticmethod(_qwen_moe_mlp)


class MixtralForCausalLM(MoEWeights, LlamaForCausalLM):
    """Mixtral (8x7B: 8 experts, top-2): Mistral's attention, experts in every MLP (the
    checkpoint's ``block_sparse_moe`` is our ``mlp``)."""

    make_mlp = staticmethod(_mixtral_mlp)

    def normalize_name(self, name: str) -> str | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return super().normalize_name(name)
