"""Mixture-of-experts layers: the router's top-k and the experts' stacked weights.

``FusedMoE`` holds every expert of a layer in two tensors, ``w13 [E, 2 * I, H]`` (gate then up,
as one matmul) and ``w2 [E, H, I]`` (down). Each token goes to its router's ``top_k`` experts;
the output is the routing-weighted sum of their ``down(act(gate(x)) * up(x))``. Under tensor
parallelism each rank holds every expert's slice of the intermediate size (``I / tp``, the
column split of gate/up and the row split of down, as a dense MLP splits), and the ranks'
partial outputs are summed by one all-reduce. With expert parallelism
(``enable_expert_parallel``) rank r holds whole experts ``[r * E / n, (r + 1) * E / n)``
instead: every rank routes every token (the attention before it is tensor-parallel, so the
ranks hold the same tokens), computes the pairs of its own experts, and the same all-reduce
sums the ranks' parts. A pair whose expert lives elsewhere gets the id ``E_local`` ("not
here"), which the experts skip.

Over data-parallel engine cores (``data_parallel_size`` with ``enable_expert_parallel``)
each core holds E / N whole experts and the block exchanges tokens with the other cores: every
core's rows gathered, each core's experts computed on all of them, the partial outputs summed
and scattered back (``distributed/expert_parallel.py``).

Each layer counts the (token, expert) pairs its experts computed (``FusedMoE.expert_load``,
on the device: no sync), padding rows excluded: a CUDA graph's padding rows (slot -1, known
from ``moe_forward_context``) and the data-parallel exchange's.

The experts run by ``fused_experts``: on a GPU one Triton grouped GEMM per projection for all
experts (``pagedllm/ops/fused_moe.py``), elsewhere the reference, which loops over the
experts a batch touches (each expert's tokens gathered, one matmul each, the weighted
results added back in expert order, as HF's modeling code does).

Example (4 tokens, E = 4, top-2): token 0 -> experts (2, 0) with weights (0.7, 0.3), ...;
expert 0 computes the rows of every token that chose it, in one matmul; each token's output
is 0.7 * expert2(x0) + 0.3 * expert0(x0).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F

from pagedllm.distributed.expert_parallel import (
    all2all_backend,
    dp_ep_info,
    dp_exchange_rows,
    dp_gather,
    dp_reduce_scatter,
)
from pagedllm.distributed.parallel_state import all_reduce, ep_info, tp_info
from pagedllm.model.layers.activation import get_act_and_mul
from pagedllm.model.layers.linear import ReplicatedLinear, _divide
from pagedllm.model.layers.norm import RMSNorm


class _ForwardRows(threading.local):
    """Per thread (dual-batch overlap runs a forward pass per thread): the forward pass's
    rows that are tokens, ``[T]`` bool (None: all)."""

    valid: torch.Tensor | None = None


_rows = _ForwardRows()


@contextlib.contextmanager
def moe_forward_context(valid: torch.Tensor | None) -> Iterator[None]:
    """While a forward pass runs: which of its rows are tokens (``valid [T]`` bool; None:
    all), for the expert-load counts. A CUDA graph captures the mask's computation."""
    saved, _rows.valid = _rows.valid, valid
    try:
        yield
    finally:
        _rows.valid = saved


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (float32), the ``top_k`` largest, renormalized to sum to 1
    when ``renormalize``: (weights [T, k] in ``weights_dtype``, expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


def fused_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: str = "silu",
) -> torch.Tensor:
    """The reference: x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k] -> [T, H].
    Experts in ascending order, each over the (token, slot) pairs that chose it; id ``E``
    is "not here" (expert parallelism) and adds nothing."""
    act_and_mul = get_act_and_mul(act)
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    counts = torch.bincount(ids.flatten(), minlength=num_experts + 1)[:num_experts]
    for e in torch.nonzero(counts).flatten().tolist():
        token, slot = torch.where(ids == e)
        h = act_and_mul(F.linear(x[token], w13[e]))  # [n, I]
        y = F.linear(h, w2[e]) * weights[token, slot, None]  # [n, H]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    act: str = "silu",
) -> torch.Tensor:
    """The experts' weighted outputs (see the module docstring): Triton on a GPU for SiLU
    experts, the reference elsewhere."""
    if x.is_cuda and act == "silu":
        from pagedllm.ops.fused_moe import fused_moe

        return fused_moe(x, w13, w2, weights, ids)
    return fused_experts_ref(x, w13, w2, weights, ids, act)


class FusedMoE(nn.Module):
    """Every expert of one layer, stacked (see the module docstring). ``weight_loader(param,
    tensor, (expert, shard))`` takes one checkpoint tensor of one expert: shard 0 gate, 1 up
    (into ``w13``), 2 down (into ``w2``); a fused checkpoint tensor of every expert comes with
    ``(None, shard)``."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden: int,
        intermediate: int,
        renormalize: bool,
        act: str,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        _, tp = tp_info()
        ep_rank, ep = ep_info()
        self.num_experts, self.top_k, self.renormalize, self.act = (
            num_experts, top_k, renormalize, act,
        )  # fmt: skip
        if ep > 1:  # whole experts per rank, each whole
            if num_experts % ep:
                raise ValueError(
                    f"the model's {num_experts} experts do not split over "
                    f"{ep} expert-parallel ranks."
                )
            self.num_local = num_experts // ep
            self.intermediate = intermediate
        else:
            self.num_local = num_experts
            self.intermediate = _divide(intermediate, tp, "moe intermediate size")
        self.first = ep_rank * self.num_local  # the global id of this rank's first expert
        self.w13 = nn.Parameter(
            torch.empty(self.num_local, 2 * self.intermediate, hidden, dtype=dtype),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(self.num_local, hidden, self.intermediate, dtype=dtype),
            requires_grad=False,
        )
        for p in (self.w13, self.w2):
            p.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # pairs computed by each local expert so far (+1: the "not here" bucket, dropped)
        self.register_buffer(
            "expert_load", torch.zeros(self.num_local + 1, dtype=torch.int64), persistent=False
        )

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int | None, int]
    ) -> None:
        expert, which = shard
        rank, tp = tp_info()
        if ep_info()[1] > 1:  # whole experts: this rank's, none of the others'
            tp = 1
            if expert is None:
                loaded = loaded[self.first : self.first + self.num_local]
            elif not self.first <= expert < self.first + self.num_local:
                return
            else:
                expert -= self.first
        n = self.intermediate
        if which == 2:  # down: [H, I] per expert, split along I
            part = loaded.chunk(tp, dim=-1)[rank] if tp > 1 else loaded
            dst = param.data if expert is None else param.data[expert]
        else:  # gate or up: [I, H] per expert, split along I, placed at its half of w13
            part = loaded.chunk(tp, dim=-2)[rank] if tp > 1 else loaded
            rows = slice(which * n, (which + 1) * n)
            dst = param.data[:, rows] if expert is None else param.data[expert, rows]
        if dst.shape != part.shape:
            raise ValueError(
                f"expert weight shape mismatch: expected {tuple(dst.shape)}, "
                f"got {tuple(part.shape)}"
            )
        dst.copy_(part)

    def forward(
        self, x: torch.Tensor, router_logits: torch.Tensor, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H] (this rank's part under TP or EP).
        ``valid [T]`` bool: the rows that are tokens (padding rows are computed by no
        expert; None: every row)."""
        weights, ids = route(router_logits, self.top_k, self.renormalize, x.dtype)
        ids = self.local_ids(ids)
        if valid is not None:
            ids = torch.where(valid[:, None], ids, self.num_local)
        return self.compute(x, weights, ids)

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids [T, k] -> this rank's (``num_local``: "not here")."""
        if self.num_local == self.num_experts:
            return ids
        local = ids - self.first  # expert parallelism: the others' are not here
        return torch.where((local >= 0) & (local < self.num_local), local, self.num_local)

    def compute(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``x [T, H]`` with routing ``weights`` and local ``ids``
        ``[T, k]``, their pairs counted: ``[T, H]``."""
        flat = ids.flatten()
        self.expert_load.scatter_add_(0, flat, torch.ones_like(flat))
        return fused_experts(x, self.w13, self.w2, weights, ids, self.act)

    def take_load(self) -> torch.Tensor:
        """The pairs each of this layer's E experts computed here since the last call
        ``[E]`` (zeros for other ranks' experts), and the count starts again."""
        load = torch.zeros(self.num_experts, dtype=torch.int64, device=self.expert_load.device)
        load[self.first : self.first + self.num_local] = self.expert_load[:-1]
        self.expert_load.zero_()
        return load


def _dispatch_combine(x: torch.Tensor, logits: torch.Tensor, experts: FusedMoE) -> torch.Tensor:
    """Expert parallelism over data-parallel cores, "alltoallv": each token goes only to the
    cores holding one of its k experts (once per core), with its routing there; each core
    computes what it received; the partial outputs come back the same way and are summed.

    Example (2 cores, 4 experts, 2 each, k = 2): token 0 -> experts (1, 3): rows to core 0
    (ids (1, -), "-": not there) and core 1 (ids (-, 1): its expert 3 is its local 1); token
    1 -> experts (0, 1): one row to core 0 only (ids (0, 1)). A core's rows go out ordered
    by destination, come back in the same order, and are added to their tokens in float32."""
    n = dp_ep_info()[1]
    t, k = x.shape[0], experts.top_k
    weights, ids = route(logits, k, experts.renormalize, x.dtype)  # [T, k] each
    owner = ids // experts.num_local  # [T, k]: the core of each pair's expert
    sends = (owner[:, :, None] == torch.arange(n, device=x.device)).any(1)  # [T, n]
    dst, token = torch.nonzero(sends.T, as_tuple=True)  # rows by destination core
    local = ids[token] - (dst * experts.num_local)[:, None]  # [rows, k]
    here = (local >= 0) & (local < experts.num_local)
    local = torch.where(here, local, experts.num_local)  # the receiver's local ids
    routing = torch.cat([local.to(torch.float32), weights[token].to(torch.float32)], 1)
    send_counts = torch.bincount(dst, minlength=n)
    (rx, rrouting), recv_counts = dp_exchange_rows([x[token], routing], send_counts)
    out_rows = experts.compute(rx, rrouting[:, k:].to(x.dtype), rrouting[:, :k].long())
    (back,), _ = dp_exchange_rows([out_rows], recv_counts, send_counts)  # rows as sent
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, token, back.float())
    return out.to(x.dtype)


class SparseMoeBlock(nn.Module):
    """The router (a replicated linear to E logits) and the experts, in place of a dense MLP;
    ``gate`` and ``experts`` are the checkpoint's names. ``shared_expert`` (Qwen2-MoE): a dense
    MLP every token goes through, scaled by ``sigmoid(shared_expert_gate(x))``, added."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        renormalize: bool,
        act: str,
        dtype: torch.dtype,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden, num_experts, False, dtype)
        self.experts = FusedMoE(num_experts, top_k, hidden, intermediate, renormalize, act, dtype)
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]
        if dp_ep_info()[1] > 1 and all2all_backend() == "alltoallv":
            out = _dispatch_combine(x, self.gate(x), self.experts)  # [T, hidden]
        elif dp_ep_info()[1] > 1:  # every core's rows; this core's experts; the sums back
            rows, valid = dp_gather(x)  # [N * T_max, hidden], [N * T_max]
            out = dp_reduce_scatter(self.experts(rows, self.gate(rows), valid))  # [T, hidden]
        else:
            out = self.experts(x, self.gate(x), _rows.valid)
            if tp_info()[1] > 1:
                out = all_reduce(out)
        if self.shared_expert is not None:  # (its down projection sums its own ranks)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(self(x), residual)``: the block's output added to the residual stream and
        normed, as a dense MLP's ``forward_add_norm``."""
        return norm(self(x), residual)
