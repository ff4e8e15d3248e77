"""Linear layers whose parameters know how to load themselves, with fused variants.

Under tensor parallelism (``pagedllm/distributed/parallel_state.py``) a column-parallel layer
holds a slice of the output features on each rank, a row-parallel one a slice of the input
features, summing the ranks' partial outputs (all-reduce) before its bias. The shard
arithmetic lives in the weight loaders: a checkpoint's whole tensor comes in, each rank keeps
its part. Attention's fused q/k/v splits heads: each rank has num_heads / tp query heads and
num_kv_heads / tp KV heads - or, with fewer KV heads than ranks, one KV head shared by
tp / num_kv_heads ranks (replicated). On one rank every layer holds the whole weight.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pagedllm.distributed.parallel_state import (
    linear_all_reduce,
    linear_all_reduce_add_rms_norm,
    tp_info,
)
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.ops.cpu import pack_linear, packed_linear


class LinearBase(nn.Module):
    """y = x W^T (+ b), with ``weight_loader`` attached to each parameter.

    On a CPU in bfloat16 or float32, ``pack_for_cpu()`` (called once the weights are loaded)
    moves the weight into oneDNN's layout (``pagedllm.ops.cpu.pack_linear``) and frees the
    plain copy; forward then runs oneDNN's matmul on it."""

    _packed: torch.Tensor | None = None
    # LoRA adapters (``pagedllm/lora/layers.py``): adds each token's x A^T B^T to the output
    lora: Any = None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            out = packed_linear(x, self._packed, self.bias)
        else:
            out = F.linear(x, self.weight, self.bias)
        return out if self.lora is None else self.lora(x, out)

    def pack_for_cpu(self) -> bool:
        """Pack the loaded weight for oneDNN (see the class docstring); False where it does
        not apply. The parameter keeps its shape's metadata only (an empty tensor): loading
        weights again is not supported after packing."""
        packed = pack_linear(self.weight.data)
        if packed is None:
            return False
        self._packed = packed
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)
        return True


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"weight shape mismatch: expected {tuple(dst.shape)}, got {tuple(src.shape)}"
        )
    dst.copy_(src)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""


def _divide(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({tp}).")
    return total // tp


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r holds rows [r * n/tp, (r + 1) * n/tp)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        _, tp = tp_info()
        super().__init__(in_features, _divide(out_features, tp, "output features"), bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rank, tp = tp_info()
        if tp > 1:
            loaded = loaded.chunk(tp, dim=0)[rank]
        _copy(param.data, loaded)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed over the ranks
    (all-reduce), then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        _, tp = tp_info()
        super().__init__(_divide(in_features, tp, "input features"), out_features, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rank, tp = tp_info()
        if param.dim() == 2 and tp > 1:
            loaded = loaded.chunk(tp, dim=1)[rank]
        _copy(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_info()[1] == 1:
            return super().forward(x)
        out = linear_all_reduce(x, self.weight)
        out = out if self.bias is None else out + self.bias
        return out if self.lora is None else self.lora(x, out)

    def forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, slot: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(self(x), residual)``: (norm(out + residual), out + residual), a pre-norm
        residual block's step. Under TP on GPUs with the symmetric-memory all-reduce, one
        kernel sums the ranks' partial outputs, adds and normalizes
        (``linear_all_reduce_add_rms_norm``: ``slot`` must alternate between consecutive
        calls); elsewhere the layer, then the norm."""
        if self.bias is None and self.lora is None and tp_info()[1] > 1:
            out = linear_all_reduce_add_rms_norm(
                x, self.weight, residual, norm.weight, norm.eps, norm.offset, slot
            )
            if out is not None:
                return out
        return norm(self(x), residual)

    def pack_for_cpu(self) -> bool:
        return tp_info()[1] == 1 and super().pack_for_cpu()  # (TP: the all-reduce path)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (gate_proj + up_proj -> gate_up_proj). ``weight_loader(param, w, shard_id)`` places shard
    ``shard_id`` (an index) at its offset."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, dtype)

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,  # type: ignore[override]
        shard_id: int,
    ) -> None:
        rank, tp = tp_info()
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        if tp > 1:
            loaded = loaded.chunk(tp, dim=0)[rank]
        _copy(param.data.narrow(0, offset, size), loaded)


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj fused: output rows [q | k | v] for this rank's heads."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        _, tp = tp_info()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "attention heads")
        self.total_kv_heads = num_kv_heads
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "KV heads")
        else:  # each KV head on tp / num_kv_heads ranks
            _divide(tp, num_kv_heads, "tensor_parallel_size over the KV heads")
            self.num_kv_heads = 1
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias, dtype)

    def weight_loader(
        self,
        param: nn.Parameter,
        loaded: torch.Tensor,  # type: ignore[override]
        shard_id: str,
    ) -> None:
        rank, tp = tp_info()
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        if tp > 1:
            if shard_id == "q" or self.total_kv_heads >= tp:
                loaded = loaded.chunk(tp, dim=0)[rank]  # whole heads (checked at init)
            else:
                # Example: 2 KV heads, 8 ranks -> ranks 0-3 hold head 0, ranks 4-7 head 1
                head = rank * self.total_kv_heads // tp
                loaded = loaded.narrow(0, head * self.head_dim, self.head_dim)
        _copy(param.data.narrow(0, offset, size), loaded)
