"""Attention over per-head paged KVs, scoring the keys as it goes (torch: the CPU backend and
the reference for the Triton kernels).

Each (request, KV head) of a layer has its own table and length (``HeadPagedCache``): head h
of request r has ``seq_lens[r, h]`` keys at logical indices 0.., this step's new keys being the
last ``q_len`` of them. A query sees every older key of its head (after eviction their order is
not their positions', but attention does not care: RoPE was applied when they were written)
and the new keys up to its own (causal); on a sliding-window layer, which is never compacted,
logical index equals position and the window is the last W keys.

Scores (one float per KV slot, GQA-aware: summed over the query heads sharing the KV head):
- decode rows add the square of each key's softmax probability (``collect`` 1), computed
  with the output, no second pass;
- the last prefill chunk of a prompt adds, for its last ``collect`` queries (the observation
  window, 32 by default), the squared probabilities summed over those queries, max-pooled
  along the sequence (kernel 31 by default) when ``maxpool`` is set;
- a row verifying draft tokens (speculative decoding: the last known token and k drafts)
  scores nothing in its step: each compressible layer keeps the row's queries
  (``VerifyQueries``), and the next step scores the keys with those of real tokens (the first
  1 + accepted drafts), as decode rows would (``HeadPagedCache.score_verified``; the rule:
  ``core/sched/kvc.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn import functional as F

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv_layout import as_bytes, quantize_fp8
from pagedllm.kvcompress.evict import head_slots, maxpool_scores


@dataclass
class VerifyQueries:
    """The queries of a step's verify rows whose keys are scored (speculative decoding), kept
    by each compressible layer's attention until the next step knows how many of each row's
    queries were of real tokens (``HeadPagedCache.score_verified``). Row w's 1 + k queries
    are ``q[layer][start[w] : start[w] + count[w]]``; they were the step's query rows
    ``rows[start[w] : ...]``.

    Example: a step of rows with 1, 4 and 3 tokens, the last two verifying drafts -> rows
    [1, 2, 3, 4, 5, 6, 7], start [0, 4], count [4, 3]."""

    req_ids: list[str]
    start: np.ndarray  # [W]
    count: np.ndarray  # [W]
    max_lens: np.ndarray  # [W] a host bound on each request's head lengths in the step
    rows: np.ndarray  # [V] the step's query rows kept, row after row
    q: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [V, Hq, d]
    # layer -> [V, Hq] float32 softmax normalizers (log2 units, the GPU prefill kernel's), or
    # None: the torch scoring recomputes the softmax
    lse: dict[int, torch.Tensor | None] = field(default_factory=dict)
    scale: dict[int, float] = field(default_factory=dict)
    window: dict[int, int | None] = field(default_factory=dict)
    k_scale: dict[int, torch.Tensor | None] = field(default_factory=dict)  # fp8: K's [H]

    def keep(
        self,
        layer: int,
        q: torch.Tensor,  # [V, Hq, d]
        lse: torch.Tensor | None,  # [V, Hq]
        scale: float,
        window: int | None,
        kv_scale: torch.Tensor | None = None,  # fp8 caches: the layer's [2, H]
    ) -> None:
        """A compressible layer's queries of the kept rows (and their normalizers)."""
        self.q[layer], self.lse[layer] = q, lse
        self.scale[layer], self.window[layer] = scale, window
        self.k_scale[layer] = None if kv_scale is None else kv_scale[0]


@dataclass
class KVCStepPlan:
    """Host-side facts of one step shared by every layer (``HeadPagedCache.prepare_step``),
    and their index tensors on the device (made once per eager step by
    ``HeadPagedCache.finish_metadata``, in one host-to-device copy; a CUDA-graph replay needs
    none): which requests decode, which run prefill chunks, and how many of each request's
    last queries score the keys (0: none).

    ``tensors``: "decode" / "prefill" (request indices), "decode_rows" (the decodes' query
    rows), "prefill_q_start" (each prefill chunk's first query row), "decode_table_rows" /
    "prefill_table_rows" (their rows of the cache's tables and lengths), "prefill_qsl"
    (query_start_loc of the prefill requests alone). Every layer of the step reads its query
    and output rows and its tables through these (no per-layer gather).
    Example: qsl [0, 1, 5, 6, 9], table rows [7, 3, 0, 4], prefill [1, 3] -> prefill_q_start
    [1, 6], prefill_table_rows [3, 4], prefill_qsl [0, 4, 7], prefill_tokens 7."""

    decode: np.ndarray  # request indices with one query
    prefill: np.ndarray  # request indices with several
    collect: np.ndarray  # [R] queries whose probabilities are added to the scores
    maxpool_kernel: int  # 0: no max-pooling of the prefill window's metric
    rows: np.ndarray  # [R] each request's row of the cache's tables
    max_lens: np.ndarray  # [R] a host bound on each request's head lengths (its tokens)
    prefill_max_q: int = 0  # the longest prefill chunk
    window_max_len: int = 0  # a bound on the head lengths of the prefill requests that score
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    prefill_tokens: int = 0  # the prefill chunks' queries (0: not given, bounded by T)
    # the verify rows whose queries the compressible layers keep ("stash_rows" in tensors)
    stash: VerifyQueries | None = None

    def bound(self, requests: np.ndarray, device: torch.device) -> int | None:
        """The longest head of these requests for a torch attention: on a GPU the host bound
        (reading the lengths would sync), elsewhere None (read them: fewer keys to gather)."""
        return int(self.max_lens[requests].max()) if device.type == "cuda" else None

    @staticmethod
    def index_arrays(
        decode: np.ndarray,
        prefill: np.ndarray,
        qsl: np.ndarray,
        rows: np.ndarray,
        collect: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]:
        """The host arrays behind ``tensors`` (see the class docstring); with ``collect``
        also the prefill requests that score ("window_reqs": their table rows) and their
        window query rows ("window_rows" [W, C], "window_mask" [W, C], "window_n" [W]: how
        many of each row's C are window queries, C the most any collects)."""
        out = KVCStepPlan._index_arrays(decode, prefill, qsl, rows)
        if collect is None:
            return out
        win = prefill[collect[prefill] > 0]
        c = int(collect[win].max()) if len(win) else 1
        n = collect[win]  # window queries of each
        i = np.arange(c)
        mask = i[None, :] < n[:, None]  # [W, C]
        last = qsl[win + 1][:, None] - n[:, None] + i[None, :]
        out["window_reqs"] = rows[win]
        out["window_rows"] = np.where(mask, last, 0)
        out["window_mask"] = mask
        out["window_n"] = n
        return out

    @staticmethod
    def _index_arrays(
        decode: np.ndarray, prefill: np.ndarray, qsl: np.ndarray, rows: np.ndarray
    ) -> dict[str, np.ndarray]:
        start = qsl[prefill]
        sub_qsl = np.zeros(len(prefill) + 1, dtype=np.int64)
        np.cumsum(qsl[prefill + 1] - start, out=sub_qsl[1:])
        return {
            "decode": decode,
            "decode_rows": qsl[decode],
            "decode_table_rows": rows[decode],
            "prefill": prefill,
            "prefill_q_start": start,
            "prefill_table_rows": rows[prefill],
            "prefill_qsl": sub_qsl,
        }


@dataclass
class KVCLayerInfo:
    """What a layer's attention needs beyond the metadata: the score and position arrays,
    whether the layer's KVs are scored, the step plan, and the step's requests' rows of the
    cache's tables (the metadata's ``block_tables`` [rows, H, max_blocks] and ``seq_lens``
    [rows, H] are the cache's whole persistent tables: no per-step gather)."""

    scores: torch.Tensor  # [num_slots] float32
    positions: torch.Tensor  # [num_slots] int32: the token position each slot holds
    token_positions: torch.Tensor  # [T] this step's tokens' positions
    compressible: bool
    plan: KVCStepPlan
    row_ids: torch.Tensor  # [R] int64: request i's row of the tables
    scored: torch.Tensor | None = None  # [rows] int32: rows whose keys are scored (decode)
    layer: int = 0  # the layer's index (``VerifyQueries`` keeps its queries by it)


def head_values(
    flat: torch.Tensor,  # [num_slots, d] K or V of the cache
    slots: torch.Tensor,  # [..., H, S]
    scale: torch.Tensor | None,  # [H] an fp8 cache's scales of K or V; None: not fp8
    dtype: torch.dtype,
) -> torch.Tensor:
    """The K or V rows at ``slots`` [..., H, S, d] in ``dtype``: an fp8 cache's times each
    head's scale (``kv_layout``: cached as fp8(x / scale))."""
    x = flat[slots]
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale.view(-1, 1, 1)).to(dtype)


def decode_attention(
    query: torch.Tensor,  # [B, Hq, d]
    k_flat: torch.Tensor,  # [num_slots, d]
    v_flat: torch.Tensor,  # [num_slots, d]
    tables: torch.Tensor,  # [B, H, max_blocks]
    lens: torch.Tensor,  # [B, H]
    block_size: int,
    scale: float,
    window: int | None = None,
    scores: torch.Tensor | None = None,  # [num_slots] float32, += sum_g p^2
    max_len: int | None = None,
    positions: torch.Tensor | None = None,  # [num_slots]; needed with a window
    q_pos: torch.Tensor | None = None,  # [B] the queries' positions; needed with a window
    kv_scale: torch.Tensor | None = None,  # [2, H] float32: an fp8 cache's scales
) -> torch.Tensor:
    """One query per row over its heads' keys; returns [B, Hq, d]. A window keeps the keys
    whose position p satisfies q_pos - window < p (compacted heads are not in position
    order, so the window is found by position)."""
    b, hq, d = query.shape
    h = tables.shape[1]
    g = hq // h
    s = int(lens.max()) if max_len is None else max_len
    out = torch.zeros_like(query)
    if s == 0:
        return out
    slots, valid = head_slots(tables, lens.long(), s, block_size)  # [B, H, S]
    if window is not None:
        assert positions is not None and q_pos is not None
        valid = valid & (positions[slots].long() > q_pos.long()[:, None, None] - window)
    k_scale, v_scale = (None, None) if kv_scale is None else kv_scale
    k = head_values(k_flat, slots, k_scale, torch.float32)  # [B, H, S, d]
    v = head_values(v_flat, slots, v_scale, torch.float32)
    q = query.view(b, h, g, d).to(torch.float32)
    logits = torch.einsum("bhgd,bhsd->bhgs", q, k) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a head with no keys: all 0
    o = torch.einsum("bhgs,bhsd->bhgd", p, v)
    if scores is not None:
        p2 = (p * p).sum(2)  # [B, H, S]; invalid entries add 0 to slot 0 (no mask: no sync)
        scores.index_add_(0, slots.reshape(-1), torch.where(valid, p2, 0.0).reshape(-1))
    return o.reshape(b, hq, d).to(query.dtype)


def prefill_attention(
    query: torch.Tensor,  # [q_len, Hq, d]
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    table: torch.Tensor,  # [H, max_blocks]
    lens: torch.Tensor,  # [H]: keys per head incl. the q_len new ones (the last of each)
    block_size: int,
    scale: float,
    window: int | None = None,
    scores: torch.Tensor | None = None,
    collect: int = 0,
    maxpool_kernel: int = 0,
    max_len: int | None = None,
    positions: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,  # [2, H] float32: an fp8 cache's scales
) -> torch.Tensor:
    """A chunk of queries of one request over its heads' keys; returns [q_len, Hq, d]. With
    ``scores``, the last ``collect`` queries' squared probabilities (summed over them and the
    group, max-pooled) are added to their keys' scores."""
    q_len, hq, d = query.shape
    h = table.shape[0]
    g = hq // h
    s = int(lens.max()) if max_len is None else max_len
    slots, valid = head_slots(table[None], lens[None].long(), s, block_size)
    slots, valid = slots[0], valid[0]  # [H, S]
    idx = torch.arange(s, device=lens.device)
    q_idx = lens[:, None] - q_len + torch.arange(q_len, device=lens.device)  # [H, q_len]
    vis = valid[:, None, :] & (idx[None, None, :] <= q_idx[..., None])  # [H, q_len, S]
    if window is not None:  # by position: a compacted head is not in position order
        assert positions is not None
        k_pos = positions[slots].long()  # [H, S]
        q_pos = k_pos.gather(1, q_idx.clamp(min=0))  # the new keys are the queries' own
        vis &= k_pos[:, None, :] > q_pos[..., None] - window
    k_scale, v_scale = (None, None) if kv_scale is None else kv_scale
    k = head_values(k_flat, slots, k_scale, query.dtype)  # [H, S, d]
    v = head_values(v_flat, slots, v_scale, query.dtype)
    q = query.view(q_len, h, g, d).permute(1, 2, 0, 3)  # [H, G, q_len, d]
    o = F.scaled_dot_product_attention(
        q,
        k[:, None].expand(h, g, s, d),
        v[:, None].expand(h, g, s, d),
        attn_mask=vis[:, None],
        scale=scale,
    )  # [H, G, q_len, d]
    if scores is not None and collect > 0:
        c = min(collect, q_len)
        add_window_scores(q[:, :, q_len - c :], k, vis[:, q_len - c :], valid, slots, scale,
                          scores, maxpool_kernel)  # fmt: skip
    return o.permute(2, 0, 1, 3).reshape(q_len, hq, d)


def add_window_scores(
    q: torch.Tensor,  # [H, G, c, d] the window's queries
    k: torch.Tensor,  # [H, S, d] the request's keys per head
    vis: torch.Tensor,  # [H, c, S] which keys each query sees
    valid: torch.Tensor,  # [H, S]
    slots: torch.Tensor,  # [H, S]
    scale: float,
    scores: torch.Tensor,  # [num_slots]
    maxpool_kernel: int,
) -> None:
    """The prompt's scores: the window queries' squared probabilities, summed over them and
    the query heads of each KV head, max-pooled along the sequence, added to the keys."""
    logits = torch.einsum("hgcd,hsd->hgcs", q.float(), k.float()) * scale
    logits = logits.masked_fill(~vis[:, None], float("-inf"))
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    metric = (p * p).sum((1, 2))  # [H, S]
    if maxpool_kernel > 1:
        metric = maxpool_scores(metric, valid, maxpool_kernel)
    # invalid entries add 0 to slot 0 (a boolean mask would sync with the host)
    scores.index_add_(0, slots.reshape(-1), torch.where(valid, metric, 0.0).reshape(-1))


def prefill_window_scores_batched(
    query: torch.Tensor,  # [T, Hq, d] the step's queries
    k_flat: torch.Tensor,  # [num_slots, d]
    tables: torch.Tensor,  # [R, H, max_blocks] the requests' tables
    lens: torch.Tensor,  # [R, H]
    last_rows: torch.Tensor,  # [R, C] int64: each request's window query rows (any valid
    # row where the mask is False)
    q_mask: torch.Tensor,  # [R, C] bool: which of the C entries are window queries
    block_size: int,
    scale: float,
    scores: torch.Tensor,
    maxpool_kernel: int,
    max_len: int,  # a host bound on lens
    window: int | None = None,
    positions: torch.Tensor | None = None,  # [num_slots]; needed with a window
    k_scale: torch.Tensor | None = None,  # [H] float32: an fp8 cache's K scales
) -> None:
    """The prompt's scores (``add_window_scores``) of every chunk that ends its prompt in a
    step, for a chunk whose output another kernel computed (the GPU path; full-attention
    layers: the window queries see every key before them), all requests at once, with no
    host sync: request r's C window queries are its last
    ``q_mask[r].sum()`` rows; query i of them sees its head's logical indices up to
    ``lens - c + i``, and with a sliding ``window`` only the keys whose position is within it
    (by position: a compacted head is not in position order). Also the verify rows' scores
    at the next step (``HeadPagedCache.score_verified``, maxpool 0).

    Example: C 3, a request with 2 window queries at rows 40, 41 -> last_rows [40, 41, 0],
    q_mask [T, T, F]; with lens [10] they see logical indices <= 8 and <= 9."""
    r, c = last_rows.shape
    hq, d = query.shape[1], query.shape[2]
    h = tables.shape[1]
    slots, valid = head_slots(tables, lens.long(), max_len, block_size)  # [R, H, S]
    n = q_mask.sum(1)  # [R] window queries per request
    i = torch.arange(c, device=lens.device)
    q_idx = lens[:, :, None] - n[:, None, None] + i  # [R, H, C] logical index of query i
    idx = torch.arange(max_len, device=lens.device)
    vis = valid[:, :, None, :] & (idx <= q_idx[..., None]) & q_mask[:, None, :, None]
    if window is not None:
        assert positions is not None
        k_pos = positions[slots].long()  # [R, H, S]
        q_pos = k_pos.gather(2, q_idx.clamp(0, max_len - 1))  # [R, H, C] the queries' own
        vis &= k_pos[:, :, None, :] > q_pos[..., None] - window
    q = query[last_rows].view(r, c, h, hq // h, d).float()  # [R, C, H, G, d]
    k = head_values(k_flat, slots, k_scale, torch.float32)  # [R, H, S, d]
    logits = torch.einsum("rchgd,rhsd->rhgcs", q, k) * scale
    logits = logits.masked_fill(~vis[:, :, None], float("-inf"))
    prob = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # padded queries: all 0
    metric = (prob * prob).sum((2, 3))  # [R, H, S]
    if maxpool_kernel > 1:
        metric = maxpool_scores(metric, valid, maxpool_kernel)
    scores.index_add_(0, slots.reshape(-1), torch.where(valid, metric, 0.0).reshape(-1))


class KVCTorchBackend(AttentionBackend):
    """Per-head paged attention in torch (see the module docstring). The layer's metadata
    (``HeadPagedCache.prepare_step``) has ``slot_mapping`` [T, H], the cache's
    ``block_tables`` [rows, H, max_blocks] and ``seq_lens`` [rows, H], and ``kvc``
    (``KVCLayerInfo``: request i's row is ``plan.rows[i]``)."""

    name = "kvc_torch"

    def forward(
        self,
        query: torch.Tensor,  # [T, Hq, d]
        key: torch.Tensor | None,  # [T, H, d]
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, d]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scale: torch.Tensor | None = None,  # [2, H] float32: an fp8 cache's scales
    ) -> torch.Tensor:
        assert key is not None and value is not None
        t, hq, d = query.shape
        info: KVCLayerInfo = metadata.kvc
        k_flat = kv_cache[0].view(-1, d)
        v_flat = kv_cache[1].view(-1, d)
        write_head_kv(key, value, k_flat, v_flat, metadata.slot_mapping, kv_scale)
        plan = info.plan
        scores = info.scores if info.compressible else None
        bs = metadata.block_size
        qsl = metadata.query_start_loc_np
        out = torch.empty_like(query)
        if len(plan.decode):
            tables_rows = plan.tensors["decode_table_rows"]
            rows = plan.tensors["decode_rows"]
            out[rows] = decode_attention(
                query[rows],
                k_flat,
                v_flat,
                metadata.block_tables[tables_rows],
                metadata.seq_lens[tables_rows],
                bs,
                scale,
                sliding_window,
                scores,
                max_len=plan.bound(plan.decode, query.device),
                positions=info.positions,
                q_pos=info.token_positions[rows] if sliding_window is not None else None,
                kv_scale=kv_scale,
            )
        for r in plan.prefill.tolist():
            a, b = int(qsl[r]), int(qsl[r + 1])
            row = int(plan.rows[r])
            out[a:b] = prefill_attention(
                query[a:b],
                k_flat,
                v_flat,
                metadata.block_tables[row],
                metadata.seq_lens[row],
                bs,
                scale,
                sliding_window,
                scores,
                int(plan.collect[r]),
                plan.maxpool_kernel,
                max_len=plan.bound(np.array([r]), query.device),
                positions=info.positions,
                kv_scale=kv_scale,
            )
        if plan.stash is not None and scores is not None:  # verify rows: scored next step
            q = query[plan.tensors["stash_rows"]]
            plan.stash.keep(info.layer, q, None, scale, sliding_window, kv_scale)
        return out.view(t, hq * d)


def write_head_kv(
    key: torch.Tensor,  # [T, H, d]
    value: torch.Tensor,
    k_flat: torch.Tensor,  # [num_slots, d]
    v_flat: torch.Tensor,
    slots: torch.Tensor,  # [T, H] int64
    kv_scale: torch.Tensor | None = None,  # [2, H] float32: an fp8 cache's scales
) -> None:
    """Store each new token's K/V of every head at its slot in that head's table (an fp8
    cache: fp8(x / scale) per head, ``kv_layout.quantize_fp8``)."""
    d = key.shape[-1]
    flat = slots.reshape(-1)
    if kv_scale is not None:
        key, value = quantize_fp8(key, kv_scale[0]), quantize_fp8(value, kv_scale[1])
    # (uint8 views of an fp8 cache: no indexed copy of float8 on a CPU)
    as_bytes(k_flat).index_copy_(0, flat, as_bytes(key.reshape(-1, d).to(k_flat.dtype)))
    as_bytes(v_flat).index_copy_(0, flat, as_bytes(value.reshape(-1, d).to(v_flat.dtype)))
