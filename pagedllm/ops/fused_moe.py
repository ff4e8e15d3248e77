"""Triton fused mixture of experts: every expert's GEMM of a layer in one launch per
projection (the reference, ``pagedllm.model.layers.moe.fused_experts_ref``, loops over the
experts).

A token goes to ``k`` experts: ``T * k`` (token, slot) pairs, pair ``p = t * k + j``. The pairs
are sorted by expert and each expert's run padded to a multiple of ``BLOCK_M``
(``moe_align``), so that every block of ``BLOCK_M`` sorted pairs belongs to one expert; the
grouped GEMM then gives each block one expert's weight. Two launches:

1. gate/up: ``inter[p] = x[p // k] @ w13[e]^T`` ([T * k, 2I]), then ``act_and_mul`` (SiLU);
2. down: ``y[p] = weight[p] * (h[p] @ w2[e]^T)`` ([T * k, H], the routing weight in the
   epilogue), and the ``k`` rows of each token summed (float32, then rounded).

Everything stays on the device, sized by the worst case (``T * k + E * (BLOCK_M - 1)``
padded pairs), with no host sync: a CUDA graph can capture it. Blocks past the padded total
exit at once.

Example (E = 3, k = 1, 5 tokens routed to experts [2, 0, 2, 2, 1], BLOCK_M = 2): counts
[1, 1, 3] pad to [2, 2, 4]; sorted pairs [1, -, 4, -, 0, 2, 3, -] (- = none); blocks 0..3 use
experts [0, 1, 2, 2]; the padded total is 8 of at most 5 + 3 * 1 = 8 rows.

Block sizes: a table tuned per device and shape (``fused_moe_configs.json`` beside this file,
written by ``benchmarks/tune_fused_moe.py``: for each token count measured, ``block_m`` and each
GEMM's ``block_n``, ``block_k``, warps and stages), the nearest token count's entry; without an
entry, the defaults of ``default_config``.

This module imports Triton at import time: import it only where Triton is installed.
"""

from __future__ import annotations

import functools
import json
import os
import re

import torch
import triton
import triton.language as tl

from pagedllm.ops.activation import act_and_mul


def moe_align(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, runs padded to ``block_m`` (see the module docstring):
    (sorted pair ids [P] int32, ``T * k`` where a pad, expert of each block [P / block_m]
    int32, the padded total [1] int32), ``P = T * k + E * (block_m - 1)`` rounded up."""
    flat = ids.flatten()  # [T * k]
    n = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded  # each expert's first padded row
    order = torch.argsort(flat, stable=True)  # pairs by expert
    first_of = torch.cumsum(counts, 0) - counts  # each expert's first sorted pair
    e_sorted = flat[order]
    rank = torch.arange(n, device=dev) - first_of[e_sorted]
    size = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids[starts[e_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, size, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1)
    total = ends[-1:].to(torch.int32)
    return sorted_ids, block_expert.to(torch.int32), total


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows of A, K]
    w_ptr,  # [E, N, K]
    c_ptr,  # [num_pairs, N]
    weight_ptr,  # [num_pairs] routing weights (MUL_WEIGHT)
    sorted_ptr,  # [P] pair ids by expert (num_pairs: a pad)
    block_expert_ptr,  # [P / BLOCK_M]
    total_ptr,  # [1] padded total
    num_pairs,
    num_experts,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    A_DIV: tl.constexpr,  # the row of A of pair p: p // A_DIV
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,  # dots in IEEE fp32: float32 inputs (no TF32), or the CPU
    # interpreter (it mis-computes bf16 dots)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < num_pairs
    rows = pairs // A_DIV
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # expert num_experts: "not here" (expert parallelism): zeros, no weight read
    k_end = tl.where(e < num_experts, K, 0)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + ks[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + e * stride_we + cols[None, :] * stride_wn + ks[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: w[e, n, k] transposed
        if IEEE:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(
        c_ptr + pairs[:, None] * stride_cm + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & col_ok[None, :],
    )


CONFIG_FILE = os.path.join(os.path.dirname(__file__), "fused_moe_configs.json")
GemmConfig = dict  # {"block_n", "block_k", "num_warps", "num_stages"}


def default_config(num_pairs: int, num_experts: int) -> dict:
    """Block sizes without a tuned entry: rows per block small when each expert gets few
    pairs (decode), else 64; 64 x 32 tiles, 4 warps."""
    per_expert = num_pairs / max(num_experts, 1)
    gemm = {"block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 2}
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    return {"block_m": block_m, "up": dict(gemm), "down": dict(gemm)}


def config_key(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str) -> str:
    """The table's key of a shape on a device. Example: (128, 2048, 768, bf16, 'NVIDIA H100
    80GB HBM3') -> 'E128_H2048_I768_bfloat16_NVIDIA_H100_80GB_HBM3'."""
    name = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_")
    return f"E{num_experts}_H{hidden}_I{inter}_{str(dtype).removeprefix('torch.')}_{name}"


@functools.lru_cache(maxsize=1)
def _table(path: str = CONFIG_FILE) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def moe_config(
    num_tokens: int, num_pairs: int, num_experts: int, hidden: int, inter: int,
    dtype: torch.dtype, device: torch.device,
) -> dict:  # fmt: skip
    """The tuned entry of the nearest measured token count, else ``default_config``."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    entries = _table().get(config_key(num_experts, hidden, inter, dtype, name))
    if entries:
        nearest = min(entries, key=lambda m: abs(int(m) - num_tokens))
        return entries[nearest]
    return default_config(num_pairs, num_experts)


def grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_pairs: int,
    a_div: int,
    block_m: int,
    weights: torch.Tensor | None = None,
    gemm: GemmConfig | None = None,
) -> torch.Tensor:
    """c[p] = a[p // a_div] @ w[expert(p)]^T (times ``weights[p]``): [num_pairs, N]."""
    sorted_ids, block_expert, total = aligned
    _, n, k = w.shape
    gemm = gemm or default_config(num_pairs, w.shape[0])["up"]
    c = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    ieee = a.device.type == "cpu" or a.dtype == torch.float32
    block_n = gemm["block_n"]
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, c, weights if weights is not None else c, sorted_ids, block_expert, total,
        num_pairs, w.shape[0], n, k, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        A_DIV=a_div, MUL_WEIGHT=weights is not None, IEEE=ieee,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=gemm["block_k"],
        num_warps=gemm["num_warps"], num_stages=gemm["num_stages"],
    )  # fmt: skip
    return c


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    config: dict | None = None,
) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], routing weights and
    expert ids [T, k] -> [T, H]: sum_j weights[t, j] * down_e(silu(gate_e(x)) * up_e(x)); an
    id of E is "not here" (expert parallelism: another rank's expert) and adds zero.
    ``config``: block sizes (``moe_config``'s shape; default: the tuned table's or defaults)."""
    t, k = ids.shape
    num_experts, hidden = w13.shape[0], w13.shape[2]
    num_pairs = t * k
    cfg = config or moe_config(t, num_pairs, num_experts, hidden, w2.shape[2], x.dtype, x.device)
    block_m = cfg["block_m"]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    aligned = moe_align(ids, num_experts + 1, block_m)  # (+1: the "not here" bucket)
    inter = grouped_gemm(x, w13, aligned, num_pairs, k, block_m, None, cfg["up"])  # [T*k, 2I]
    h = act_and_mul(inter, "silu")  # [T * k, I]
    flat_w = weights.reshape(-1).contiguous()
    y = grouped_gemm(h, w2, aligned, num_pairs, 1, block_m, flat_w, cfg["down"])  # [T*k, H]
    return y.view(t, k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
