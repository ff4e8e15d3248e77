"""LoRA on a model's projections: stacked adapter slots beside each target layer.

Each target layer (a decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``) gets a ``LoRALayer`` as its ``lora`` attribute; ``LinearBase.forward`` hands it
its input and output, and it adds ``x A^T B^T`` per token with the token's adapter slot
(``LoRABatch``). The weights of ``max_loras`` adapters live in slot buffers padded to the
slots' rank R (``LoRAConfig.slot_rank``), allocated once:

    A [max_loras, S * R, in]    S sub-projections: q, k, v of qkv_proj; gate, up of gate_up_proj
    B [max_loras, out, R]       each sub-projection's B in its own output rows

so a fused layer has one LoRA slice per sub-projection (zeros where the adapter does not
target it), and loading an adapter is a copy into a slot: a captured CUDA graph keeps its
pointers. The scale is already in B (``peft_loader.py``).

Tensor parallelism: a slice is sharded as its layer's weight is, by the layer's own
``weight_loader`` (one rule for both): column-parallel layers (qkv, gate_up) keep A whole and
their rows of B; row-parallel ones (o, down) keep their columns of A and B whole, and the
shrink's partial sums are added over the ranks (one all-reduce of [S, T, R]) before the
expand.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.distributed.parallel_state import all_reduce, tp_info
from pagedllm.lora.batch import LoRABatch
from pagedllm.lora.ops import lora_expand_ref, lora_shrink_ref
from pagedllm.lora.peft_loader import LoRAWeights
from pagedllm.model.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

# fused layer -> its sub-projections, each (checkpoint module, shard id of its weight_loader)
TARGETS: dict[str, tuple[str, tuple[tuple[str, Any], ...]]] = {
    "qkv_proj": ("self_attn", (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"))),
    "o_proj": ("self_attn", (("o_proj", None),)),
    "gate_up_proj": ("mlp", (("gate_proj", 0), ("up_proj", 1))),
    "down_proj": ("mlp", (("down_proj", None),)),
}


class _Into:
    """A slot's tensor in the place of a layer's parameter, so that the layer's
    ``weight_loader`` (which reads ``.data`` and ``.dim()``) shards a LoRA slice into it."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data

    def dim(self) -> int:
        return self.data.dim()


def _sub_ranges(layer: LinearBase) -> list[tuple[int, int]]:
    """(offset, size) of each sub-projection in this rank's output rows. Example (q 64, k and
    v 32 on one rank): [(0, 64), (64, 32), (96, 32)]."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        return [(0, q), (q, kv), (q + kv, kv)]
    if isinstance(layer, MergedColumnParallelLinear):
        tp = tp_info()[1]
        sizes = [s // tp for s in layer.output_sizes]
        return [(sum(sizes[:i]), s) for i, s in enumerate(sizes)]
    return [(0, layer.out_features)]


class LoRALayer:
    """The adapter slots of one target layer and their forward (see the module docstring)."""

    def __init__(
        self,
        base: LinearBase,
        subs: tuple[tuple[str, Any], ...],
        batch: LoRABatch,
        rank: int,
    ) -> None:
        self.base = base
        self.subs = subs
        self.batch = batch
        self.rank = rank  # R
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.ranges = _sub_ranges(base)
        dtype, device = base.weight.dtype, batch.device
        L, S = batch.max_loras, len(subs)
        self.a = torch.zeros(L, S * rank, base.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(L, base.out_features, rank, dtype=dtype, device=device)
        # [2S] offsets, then sizes (the expand kernel's table)
        flat = [o for o, _ in self.ranges] + [n for _, n in self.ranges]
        self.ranges_dev = torch.tensor(flat, dtype=torch.int64, device=device)
        self.max_sub = max(n for _, n in self.ranges)

    def load(self, slot: int, weights: LoRAWeights | None, layer_idx: int) -> None:
        """Put an adapter's slices of this layer into ``slot`` (zeros for the sub-projections
        it does not target, and past its rank); None clears the slot."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if weights is None:
            return
        R = self.rank
        for k, (module, shard) in enumerate(self.subs):
            ab = weights.modules.get((layer_idx, module))
            if ab is None:
                continue
            a, b = ab  # [r, in], [out, r] (whole)
            r = a.shape[0]
            if self.row_parallel:  # this rank's input columns of A; B whole
                self.base.weight_loader(_Into(self.a[slot, :r]), a)
                self.b[slot, :, :r].copy_(b)
            else:  # A whole; this rank's rows of B, at the sub-projection's offset
                self.a[slot, k * R : k * R + r].copy_(a)
                target = _Into(self.b[slot, :, :r])
                if shard is None:
                    self.base.weight_loader(target, b)
                else:
                    self.base.weight_loader(target, b, shard)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` ([T, out], the base layer's output for [T, in] ``x``) plus each token's
        adapter, in place; tokens of the base model are left as they are."""
        batch = self.batch
        if not batch.cuda:
            if not batch.groups:
                return out
            s = lora_shrink_ref(x, self.a, batch.groups, self.rank)  # [S, T, R]
            if self.row_parallel:
                s = all_reduce(s.contiguous())
            lora_expand_ref(s, self.b, out, batch.groups, self.ranges)
            return out
        # GPU: always launched (a CUDA graph replays it whatever the step's adapters)
        from pagedllm.ops.lora import lora_expand, lora_shrink

        meta, m = batch.meta, batch.max_num_tokens
        s = lora_shrink(x.contiguous(), self.a, meta, m, self.rank)
        if self.row_parallel:
            s = all_reduce(s)
        lora_expand(s, self.b, out, meta, self.ranges_dev, m, self.max_sub)
        return out


def attach_lora(model: torch.nn.Module, batch: LoRABatch, rank: int) -> dict[tuple, LoRALayer]:
    """Give every target layer of the model's decoder layers its ``LoRALayer``; returns them
    by (layer index, fused name). ValueError if the model has no such layers."""
    layers: dict[tuple, LoRALayer] = {}
    for i, decoder in enumerate(model.model.layers):
        for fused, (block, subs) in TARGETS.items():
            base = getattr(getattr(decoder, block, None), fused, None)
            if isinstance(base, LinearBase):
                base.lora = LoRALayer(base, subs, batch, rank)
                layers[(i, fused)] = base.lora
    if not layers:
        raise ValueError(f"enable_lora: {type(model).__name__} has no projections to adapt.")
    return layers
