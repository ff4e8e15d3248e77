"""Decode context parallelism (DCP): attention over a KV cache whose tokens are split over ranks.

With fewer KV heads than tensor-parallel ranks, tensor parallelism puts a copy of each KV head
on tp / num_kv_heads ranks. ``decode_context_parallel_size`` D splits the tokens of those
copies instead: a group of D consecutive ranks (which hold the same KV head) stores each
request's positions round-robin, rank r the positions p with p % D == r
(``kv_layout.dcp_slot_mapping``), so the same memory holds D times the context. Every rank
still computes the K/V of every token (its projections are those of a replica); it writes
only its own.

Attention of one layer, on every rank of the group (the rows and metadata are the same):

1. the group's query heads are all-gathered: rank r's ``H`` heads become the group's
   ``D * H`` (rank 0's first), every one of them reading this rank's KV head(s);
2. each rank attends them over its share of the keys, giving an output and its log-sum-exp
   per row and head. Query row at position p sees the local key j (position j * D + r) when
   j * D + r <= p (and within the sliding window, by position), so prefill chunks, decodes
   and multi-token rows (speculative decoding) are attended alike;
3. the partial outputs are merged by their log-sum-exp: with L = logsumexp over the ranks'
   lse, rank r's output is weighted by exp(lse_r - L), and a reduce-scatter sums the
   weighted outputs, each rank getting its own H heads.

Example: D 2, a decode at position 4 (keys 0..4): rank 0 attends keys 0, 2, 4 (local 0..2),
rank 1 keys 1, 3 (local 0..1); softmax over all five = the two partial softmaxes, each
weighted by its share exp(lse_r - L) of the total mass.

On a CPU, steps 2 and 3 are PyTorch (float32 scores, one call per request: also the
reference); on a GPU, step 2 is a Triton kernel on the unified paged kernel's tiling and the
weights of step 3 one fused kernel before the reduce-scatter (``ops/dcp_attention.py``).
GPU steps run eagerly under DCP (not captured in CUDA graphs yet).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backends.torch_native import visible_keys
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import dcp_all_gather, dcp_reduce_scatter
from pagedllm.kv_layout import dcp_local_lens, dequantize, token_slots


def _plan(md: AttentionMetadata, window: int | None, device: torch.device) -> list[tuple]:
    """Per request (query start, end, its local keys' slots [K], mask [Q, K]): planned once
    a step for every layer of one window."""
    key = ("dcp", window, device)
    if key in md.plan:
        return md.plan[key]
    assert md.dcp is not None and md.query_start_loc_np is not None
    assert md.seq_lens_np is not None
    rank, size = md.dcp
    tables = md.plan.get("block_tables_np")
    if tables is None:
        tables = md.plan["block_tables_np"] = md.block_tables.cpu().numpy()
    qsl, seq_lens = md.query_start_loc_np, md.seq_lens_np
    plan = []
    for r in range(md.num_reqs):
        start, end, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
        q_pos = np.arange(seq_len - (end - start), seq_len)  # [Q] the rows' positions
        local = np.arange(int(dcp_local_lens(seq_len, rank, size)))  # [K] this rank's keys
        k_pos = local * size + rank
        if window is not None:  # keys older than every row's window are never read
            keep = k_pos > q_pos[0] - window
            local, k_pos = local[keep], k_pos[keep]
        vis = visible_keys(q_pos, k_pos, window)  # [Q, K] by position
        slots = token_slots(tables[r], local, md.block_size)
        plan.append(
            (start, end, torch.from_numpy(slots).to(device), torch.from_numpy(vis).to(device))
        )
    md.plan[key] = plan
    return plan


def attend_local(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the group's query heads
    kv_cache: torch.Tensor,  # [2, num_blocks, page_tokens, num_kv_heads, head_dim]
    md: AttentionMetadata,
    scale: float,
    window: int | None,
    kv_scale: torch.Tensor | None = None,  # [2, num_kv_heads] float32: fp8 caches only
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 of the module docstring: (output [num_tokens, num_heads, head_dim] float32,
    log-sum-exp [num_tokens, num_heads] float32) over this rank's keys; a row with none of
    them visible has output 0 and lse -inf."""
    n, heads, head_dim = query.shape
    kvh = kv_cache.shape[3]
    k_flat = kv_cache[0].view(-1, kvh, head_dim)
    v_flat = kv_cache[1].view(-1, kvh, head_dim)
    k_scale, v_scale = (kv_scale[0], kv_scale[1]) if kv_scale is not None else (None, None)
    out = torch.zeros(n, heads, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.full((n, heads), float("-inf"), dtype=torch.float32, device=query.device)
    for start, end, slots, vis in _plan(md, window, query.device):
        q = query[start:end].float().transpose(0, 1)  # [H, Q, d]
        k = dequantize(k_flat.index_select(0, slots), k_scale, torch.float32)  # [K, kvh, d]
        v = dequantize(v_flat.index_select(0, slots), v_scale, torch.float32)
        k = k.transpose(0, 1).repeat_interleave(heads // kvh, 0)  # [H, K, d]
        v = v.transpose(0, 1).repeat_interleave(heads // kvh, 0)
        s = (q @ k.transpose(1, 2) * scale).masked_fill(~vis, float("-inf"))  # [H, Q, K]
        row_lse = torch.logsumexp(s, dim=-1)  # [H, Q]
        p = torch.exp(s - row_lse[..., None]).nan_to_num_(0.0)  # (-inf rows: 0)
        out[start:end] = (p @ v).transpose(0, 1)
        lse[start:end] = row_lse.transpose(0, 1)
    return out, lse


def merge(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Step 3: this rank's heads [num_tokens, H, head_dim] of the group's merged output, from
    its partial ``out`` [num_tokens, D * H, head_dim] and ``lse`` [num_tokens, D * H]."""
    n, group_heads, head_dim = out.shape
    lse_all = dcp_all_gather(lse)  # [D, num_tokens, D * H]
    size = lse_all.shape[0]
    total = torch.logsumexp(lse_all, dim=0)  # [num_tokens, D * H]
    weight = torch.exp(lse - total).nan_to_num_(0.0)  # (rows no rank sees: padding)
    weighted = (out * weight[..., None]).view(n, size, group_heads // size, head_dim)
    return dcp_reduce_scatter(weighted.transpose(0, 1))  # [num_tokens, H, head_dim]


def dcp_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: this rank's query heads
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    window: int | None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The layer's attention output [num_tokens, num_heads * head_dim] under DCP (the
    module docstring's three steps); the step's K/V must already be in the cache."""
    n, heads, head_dim = query.shape
    group_q = dcp_all_gather(query)  # [D, num_tokens, H, head_dim]
    group_q = group_q.transpose(0, 1).reshape(n, -1, head_dim)  # [num_tokens, D * H, d]
    if query.is_cuda:  # the Triton kernels (ops/dcp_attention.py)
        from pagedllm.ops.dcp_attention import dcp_combine, dcp_paged_attention

        assert md.dcp is not None
        rank, size = md.dcp
        out, lse = dcp_paged_attention(
            group_q, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables,
            md.max_query_len, rank, size, scale, window, kv_scale,
        )  # fmt: skip
        merged = dcp_reduce_scatter(dcp_combine(out, dcp_all_gather(lse), rank))
    else:
        merged = merge(*attend_local(group_q, kv_cache, md, scale, window, kv_scale))
    return merged.to(query.dtype).view(n, heads * head_dim)
