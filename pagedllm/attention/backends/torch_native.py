"""Paged attention in plain PyTorch: the CPU backend and the reference for the GPU kernels.

Decode rows (one query token per request) of a step are attended by the compiled kernel of
``pagedllm/ops/cpu`` where it is built (float32, bfloat16 and fp8 caches; see
``kernels_enabled``),
which reads K and V from their blocks in place, the query heads of a KV head together; else in
one batched SDPA call over keys gathered from their blocks. The prefill chunks of a step go
to the compiled ``paged_prefill`` in one call (bfloat16 and float32 on CPUs with AVX512-BF16;
an fp8 cache's chunks read their blocks dequantized into a small cache of the query's dtype;
AMX tiles in bfloat16 where there are: the keys and values read from their blocks, laid out
once per KV head for all its query heads); elsewhere each chunk gets its own SDPA call (or,
for a first chunk on a full-attention layer, plain causal SDPA over its new keys without
touching the cache). The gather indices, masks and tables are planned once per step and
shared by every layer.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv_layout import dequantize, is_fp8, token_slots, write_kv_ref

_CPU = torch.device("cpu")


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """``write_kv_ref``, through the compiled row copy on a CPU where it is built
    (``pagedllm/ops/cpu.write_kv``: a row copy per token, without the reference's masking and
    two indexed copies, whose dispatch outweighs a decode step's few rows; not for fp8)."""
    if kv_cache.device.type == "cpu" and not is_fp8(kv_cache.dtype):
        from pagedllm.ops.cpu import write_kv

        if write_kv(key, value, kv_cache, slot_mapping):
            return
    write_kv_ref(key, value, kv_cache, slot_mapping, kv_scale)


def _decode_kernel(dtype: torch.dtype | None = None) -> object | None:
    """The compiled kernels' module (``paged_decode``, and ``paged_prefill`` for the prefill
    chunks) where it is used for a cache of ``dtype`` (see ``pagedllm/ops/cpu.kernels_enabled``:
    float32 and bfloat16), else None (PyTorch)."""
    from pagedllm.ops.cpu import cpu_ops, kernels_enabled

    return cpu_ops() if kernels_enabled(dtype) else None


def _local_tables(
    tables: np.ndarray, seq_lens: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """(tables over a small cache of only the blocks they use, those blocks' ids): an fp8
    cache's prefill chunks read their blocks dequantized into it.
    Example: tables [[7, 3], [3, 9]], lengths [20, 5], bs 16 -> blocks [3, 7] (row 1 uses
    only its first), tables [[1, 0], [0, 0]]."""
    used = np.arange(tables.shape[1])[None, :] < -(-seq_lens[:, None] // block_size)
    blocks = np.unique(tables[used]).astype(np.int64)
    local = np.where(used, np.searchsorted(blocks, tables), 0).astype(np.int32)
    return np.ascontiguousarray(local), blocks


def visible_keys(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None) -> np.ndarray:
    """Which keys (by position) each query row (by position) attends: causal, and inside the
    window when there is one (also decode context parallelism's rule, ``attention/dcp.py``)."""
    # [num_queries, num_keys] bool: causal, within the window when one is given
    vis = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        vis &= k_pos[None, :] > q_pos[:, None] - window
    return vis


class TorchNativeBackend(AttentionBackend):
    """CPU paged attention with torch SDPA (see module docstring)."""

    name = "torch_native"

    _kv_write = staticmethod(write_kv_cache)

    def _plan(
        self,
        md: AttentionMetadata,
        window: int | None,
        device: torch.device = _CPU,
        dtype: object = None,
    ) -> dict:
        """The step's decode rows and prefill chunks, planned once for all layers; index
        tensors live on ``device`` (the query's: the SDPA paths also run on a GPU)."""
        key = ("torch_native", window, device, dtype)
        on_cpu = device.type == "cpu"
        if key in md.plan:
            return md.plan[key]
        qsl = md.query_start_loc_np
        seq_lens = md.seq_lens_np
        assert qsl is not None and seq_lens is not None
        block_tables = md.plan.get("block_tables_np")
        if block_tables is None:
            block_tables = md.block_tables.cpu().numpy()
            md.plan["block_tables_np"] = block_tables
        bs = md.block_size
        q_lens = np.diff(qsl[: md.num_reqs + 1])
        dec = np.nonzero(q_lens == 1)[0]
        pre = np.nonzero(q_lens > 1)[0]  # the prefill chunks' requests
        plan: dict = {
            "decode": None,
            "prefill_reqs": pre,
            "prefill": None,
            "prefill_kernel": None,
            "prefill_blocks": None,  # fp8: the blocks the prefill kernel reads, dequantized
            "device": device,
        }
        if len(dec) > 0 and on_cpu and _decode_kernel(dtype) is not None:
            # the compiled kernel reads the blocks itself: the rows' tables and lengths
            plan["decode"] = (
                "kernel",
                torch.from_numpy(qsl[dec].astype(np.int64)),
                torch.from_numpy(np.ascontiguousarray(block_tables[dec], dtype=np.int32)),
                torch.from_numpy(seq_lens[dec].astype(np.int32)),
            )
        elif len(dec) > 0:
            lens = seq_lens[dec][:, None]
            # keys a decode row reads: its whole context, or the last `window` positions
            # Example: window 4, lens [3, 9] -> s_max 4; first [0, 5]; row 0 reads 0..2 (3 is
            # past it), row 1 reads 5..8.
            s_max = int(lens.max()) if window is None else min(int(lens.max()), window)
            first = np.zeros_like(lens) if window is None else np.maximum(lens - window, 0)
            pos = first + np.arange(s_max)[None, :]  # [num_decodes, s_max]
            valid = pos < lens
            pos = np.where(valid, pos, 0)
            slots = np.where(valid, token_slots(block_tables[dec], pos, bs), 0)
            plan["decode"] = (
                torch.from_numpy(qsl[dec].astype(np.int64)).to(device),
                torch.from_numpy(slots.reshape(-1)).to(device),
                torch.from_numpy(valid)[:, None, None, :].to(device),  # [B, 1, 1, s_max]
                s_max,
            )
        if len(pre) > 0 and on_cpu and _decode_kernel(dtype) is not None:
            # the compiled prefill kernel (it may still decline: then the SDPA plan below)
            tables = np.ascontiguousarray(block_tables[pre], dtype=np.int32)
            if is_fp8(dtype):  # it reads the chunks' blocks, dequantized, from a small cache
                tables, blocks = _local_tables(tables, seq_lens[pre], bs)
                plan["prefill_blocks"] = torch.from_numpy(blocks)
            plan["prefill_kernel"] = (
                torch.from_numpy(qsl[pre].astype(np.int64)),
                torch.from_numpy(q_lens[pre].astype(np.int32)),
                torch.from_numpy(seq_lens[pre].astype(np.int32)),
                torch.from_numpy(tables),
            )
        md.plan[key] = plan
        return plan

    def _sdpa_prefill(
        self, md: AttentionMetadata, plan: dict, window: int | None, fp8: bool = False
    ) -> list:
        """The SDPA calls of the step's prefill chunks (planned at the first layer that
        needs them): (start, end, slots or None, mask or None) a chunk. An fp8 cache's chunks
        all read their keys from the cache (as the GPU kernels do), so a prompt attends to the
        same quantized K/V whether it is cached, chunked or recomputed."""
        if plan["prefill"] is not None:
            return plan["prefill"]
        qsl, seq_lens = md.query_start_loc_np, md.seq_lens_np
        assert qsl is not None and seq_lens is not None
        block_tables, bs = md.plan["block_tables_np"], md.block_size
        plan["prefill"] = []
        for r in plan["prefill_reqs"]:
            start, end, seq_len = int(qsl[r]), int(qsl[r + 1]), int(seq_lens[r])
            ctx = seq_len - (end - start)
            if ctx == 0 and window is None and not fp8:
                plan["prefill"].append((start, end, None, None))  # pure causal over new keys
                continue
            k_pos = np.arange(seq_len)
            q_pos = np.arange(ctx, seq_len)
            if window is not None:  # keys older than every query's window are never read
                first = max(0, ctx - window + 1)
                k_pos = k_pos[first:]
            slots = torch.from_numpy(token_slots(block_tables[r], k_pos, bs)).to(plan["device"])
            mask = torch.from_numpy(visible_keys(q_pos, k_pos, window))[None, None]
            plan["prefill"].append((start, end, slots, mask.to(plan["device"])))
        return plan["prefill"]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        kv_scale: torch.Tensor | None = None,  # [2, num_kv_heads] float32: fp8 caches only
    ) -> torch.Tensor:
        assert key is not None and value is not None, "this backend does not fuse rope"
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping, kv_scale)
        fp8 = is_fp8(kv_cache.dtype)
        k_scale, v_scale = (kv_scale[0], kv_scale[1]) if kv_scale is not None else (None, None)
        k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)
        v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
        plan = self._plan(metadata, sliding_window, query.device, kv_cache.dtype)
        out = torch.empty_like(query)
        gqa = num_heads != num_kv_heads
        if plan["decode"] is not None and plan["decode"][0] == "kernel":
            _, rows, tables, lens = plan["decode"]
            every = rows.shape[0] == num_tokens  # a step of decodes only: rows 0 .. T - 1
            q = query if every else query.index_select(0, rows)  # [B, num_heads, head_dim]
            extra = {"kv_scale": kv_scale} if fp8 else {}  # fp8: bytes through a table
            o = _decode_kernel(kv_cache.dtype).paged_decode(  # type: ignore[union-attr]
                q, kv_cache[0], kv_cache[1], tables, lens, scale, sliding_window or 0, **extra
            )
            if every:
                return o.view(num_tokens, num_heads * head_dim)
            out.index_copy_(0, rows, o)
        elif plan["decode"] is not None:
            rows, slots, mask, s_max = plan["decode"]
            b = rows.shape[0]
            q = query.index_select(0, rows).unsqueeze(2)  # [B, num_heads, 1, head_dim]
            k = k_flat.index_select(0, slots).view(b, s_max, num_kv_heads, head_dim)
            v = v_flat.index_select(0, slots).view(b, s_max, num_kv_heads, head_dim)
            o = F.scaled_dot_product_attention(
                q,
                dequantize(k, k_scale, q.dtype).transpose(1, 2),
                dequantize(v, v_scale, q.dtype).transpose(1, 2),
                attn_mask=mask,
                scale=scale,
                enable_gqa=gqa,
            )  # [B, num_heads, 1, head_dim]
            out.index_copy_(0, rows, o.squeeze(2))
        kp = plan["prefill_kernel"]
        if kp is not None:
            kc, vc = kv_cache[0], kv_cache[1]
            blocks = plan["prefill_blocks"]
            if blocks is not None:  # fp8: the blocks the chunks read, in the query's dtype
                kc = dequantize(kc.index_select(0, blocks), k_scale, query.dtype)
                vc = dequantize(vc.index_select(0, blocks), v_scale, query.dtype)
            if _decode_kernel(kv_cache.dtype).paged_prefill(  # type: ignore[union-attr]
                query, kc, vc, *kp, scale, sliding_window or 0, out
            ):
                return out.view(num_tokens, num_heads * head_dim)
        # [1, heads, len, head_dim]: 4-D inputs take torch's flash-attention CPU kernel (several
        # times faster), 3-D ones its math fallback; so bfloat16 attends in bfloat16 here
        for start, end, slots, mask in self._sdpa_prefill(metadata, plan, sliding_window, fp8):
            q = query[start:end].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
            if slots is None:
                k, v = key[start:end], value[start:end]
                o = F.scaled_dot_product_attention(
                    q,
                    k.transpose(0, 1)[None],
                    v.transpose(0, 1)[None],
                    is_causal=True,
                    scale=scale,
                    enable_gqa=gqa,
                )[0]
            else:
                k = dequantize(k_flat.index_select(0, slots), k_scale, q.dtype)
                v = dequantize(v_flat.index_select(0, slots), v_scale, q.dtype)
                o = F.scaled_dot_product_attention(
                    q,
                    k.transpose(0, 1)[None],
                    v.transpose(0, 1)[None],
                    attn_mask=mask,
                    scale=scale,
                    enable_gqa=gqa,
                )[0]
            out[start:end] = o.transpose(0, 1).to(out.dtype)
        return out.view(num_tokens, num_heads * head_dim)
