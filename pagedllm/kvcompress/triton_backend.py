"""The GPU backend of KV-Compress: Triton kernels over per-head tables and lengths.

Per layer and step:
- the new K/V go to their per-head slots (``write_head_kv``, one indexed copy);
- decode rows: ``kvc_decode_attention``, one program per (row, KV head) for the query heads
  that share it, adding each key's squared probabilities to its score in the same kernel (a
  second pass over the keys once the softmax's max and sum are known, no scratch);
- prefill chunks: ``kvc_paged_attention`` (each (request, KV head) a pseudo-request of the
  unified paged kernel), then, for a chunk that ends a prompt, the window queries' scores in
  torch (``prefill_window_scores``: 32 queries over the prompt's keys).
A compacted sliding-window layer (only when every layer has a window, Mistral v0.1) is not in
position order: its decode rows take the torch path, which applies the window by position.

Importing this module imports Triton; the runner imports it only on a GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kvcompress.attention import (
    KVCLayerInfo,
    decode_attention,
    prefill_attention,
    prefill_window_scores,
    write_head_kv,
)
from pagedllm.ops.kvc_attention import kvc_decode_attention, kvc_paged_attention


class KVCTritonBackend(AttentionBackend):
    """Per-head paged attention with Triton kernels (see the module docstring)."""

    name = "kvc_triton"

    def forward(
        self,
        query: torch.Tensor,  # [T, Hq, d]
        key: torch.Tensor | None,  # [T, H, d]
        value: torch.Tensor | None,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, d]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        assert key is not None and value is not None
        t, hq, d = query.shape
        info: KVCLayerInfo = metadata.kvc
        k_flat = kv_cache[0].view(-1, d)
        v_flat = kv_cache[1].view(-1, d)
        write_head_kv(key, value, k_flat, v_flat, metadata.slot_mapping)
        plan = info.plan
        dev = query.device
        scores = info.scores if info.compressible else None
        bs = metadata.block_size
        qsl = metadata.query_start_loc_np
        assert qsl is not None
        by_position = sliding_window is not None and info.compressible
        tensors = plan.device_tensors(dev, qsl)
        if len(plan.prefill) == 0 and not by_position:  # decode-only step: one kernel
            out = kvc_decode_attention(
                query, kv_cache, metadata.block_tables, metadata.seq_lens, scale,
                scores=scores, sliding_window=sliding_window,
            )  # fmt: skip
            return out.view(t, hq * d)
        out = torch.empty_like(query)
        if len(plan.decode):
            dec, rows = tensors["decode"], tensors["decode_rows"]
            args = (metadata.block_tables[dec], metadata.seq_lens[dec])
            if by_position:
                out[rows] = decode_attention(
                    query[rows], k_flat, v_flat, *args, bs, scale, sliding_window, scores,
                    positions=info.positions, q_pos=info.token_positions[rows],
                )  # fmt: skip
            else:
                out[rows] = kvc_decode_attention(
                    query[rows], kv_cache, *args, scale, scores=scores,
                    sliding_window=sliding_window,
                )  # fmt: skip
        if len(plan.prefill) == 0:
            return out.view(t, hq * d)
        if by_position:  # rare (every layer windowed): the torch path, by position
            for r in plan.prefill.tolist():
                a, b = int(qsl[r]), int(qsl[r + 1])
                out[a:b] = prefill_attention(
                    query[a:b], k_flat, v_flat, metadata.block_tables[r],
                    metadata.seq_lens[r], bs, scale, sliding_window, scores,
                    int(plan.collect[r]), plan.maxpool_kernel, positions=info.positions,
                )  # fmt: skip
            return out.view(t, hq * d)
        pre, rows, sub_qsl = tensors["prefill"], tensors["prefill_rows"], tensors["prefill_qsl"]
        sub = kvc_paged_attention(
            query[rows] if len(plan.decode) else query[: int(qsl[-1])],
            kv_cache,
            sub_qsl,
            metadata.seq_lens[pre],
            metadata.block_tables[pre],
            tensors["prefill_max_q"],
            int(metadata.max_seq_len),
            scale,
            sliding_window,
        )
        if len(plan.decode):
            out[rows] = sub
        else:
            out[: sub.shape[0]] = sub
        if scores is not None:
            for r in np.nonzero(plan.collect[plan.prefill] > 0)[0].tolist():
                req = int(plan.prefill[r])
                a, b = int(qsl[req]), int(qsl[req + 1])
                prefill_window_scores(
                    query[a:b], k_flat, metadata.block_tables[req], metadata.seq_lens[req],
                    bs, scale, scores, int(plan.collect[req]), plan.maxpool_kernel,
                )  # fmt: skip
        return out.view(t, hq * d)
