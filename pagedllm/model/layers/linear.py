"""Linear layers whose parameters know how to load themselves, with fused variants.

Tensor parallelism will split these along their output (column) or input (row) dimension; the
shard arithmetic lives in the weight loaders so the models need not change when it arrives.
Today tp_size is 1 and every rank holds the whole weight.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def tp_info() -> tuple[int, int]:
    """(rank, world size) of the tensor-parallel group; (0, 1) until distributed lands."""
    return 0, 1


class LinearBase(nn.Module):
    """y = x W^T (+ b), with ``weight_loader`` attached to each parameter."""

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
        return F.linear(x, self.weight, self.bias)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"weight shape mismatch: expected {tuple(dst.shape)}, got {tuple(src.shape)}"
        )
    dst.copy_(src)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        _, tp = tp_info()
        super().__init__(in_features, out_features // tp, bias, dtype)


class RowParallelLinear(LinearBase):
    """Input features split across ranks (an all-reduce follows under TP)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        _, tp = tp_info()
        super().__init__(in_features // tp, out_features, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rank, tp = tp_info()
        if param.dim() == 2 and tp > 1:
            loaded = loaded.chunk(tp, dim=1)[rank]
        _copy(param.data, loaded)


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
        self.num_heads = num_heads // tp
        self.num_kv_heads = max(1, num_kv_heads // tp)
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
            loaded = loaded.chunk(tp, dim=0)[rank]  # heads divisible by tp (checked at init)
        _copy(param.data.narrow(0, offset, size), loaded)
