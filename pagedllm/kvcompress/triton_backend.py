"""The GPU backend of KV-Compress: Triton kernels over per-head tables and lengths.

Per layer and step:
- the new K/V go to their per-head slots inside the layer's rope kernel
  (``rope_and_cache`` with a [T, H] slot list; ``write_head_kv`` when a caller passes K/V);
- decode rows: ``kvc_decode_attention``, one program per (row, KV head) for the query heads
  that share it, adding each key's squared probabilities to its score in the same kernel (a
  second pass over the keys once the softmax's max and sum are known, no scratch);
- prefill chunks: ``kvc_paged_attention`` (one program per (query tile, KV head) over that
  head's own table), storing each query's softmax normalizer when a chunk ends a prompt;
  then ``kvc_window_scores`` scores that prompt's keys from its last 32 queries (one program
  per (request, KV head, key tile), every such request of the step in one launch, and one
  more for the max-pool); a row verifying drafts (speculative decoding) keeps its queries and
  their normalizers instead, for ``HeadPagedCache.score_verified`` at the next step.
In a mixed step both kernels read their query rows and write their output rows of the step in
place, through index tensors made once a step (``KVCStepPlan.tensors``), and the cache's whole
tables through table-row indices: no per-layer gather, scatter or permutation.
A compacted sliding-window layer (only when every layer has a window, Mistral v0.1) is not in
position order: its decode rows take the torch path, which applies the window by position.
An fp8 cache (``kv_cache_dtype fp8``): the kernels read the stored e4m3 codes in the query's
dtype; each query head is multiplied by its KV head's K scale first (the logits, hence the
softmax and the scores, are those over fp8 x scale) and each output by the V scale after.

Importing this module imports Triton; the runner imports it only on a GPU.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backends.base import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kvcompress.attention import (
    KVCLayerInfo,
    decode_attention,
    prefill_attention,
    write_head_kv,
)
from pagedllm.kvcompress.cache import HeadPagedCache
from pagedllm.ops.kvc_attention import (
    kvc_decode_attention,
    kvc_decode_auto_splits,
    kvc_paged_attention,
    kvc_window_scores,
)
from pagedllm.ops.paged_attention import prefill_variant_query_lens


class KVCTritonBackend(AttentionBackend):
    """Per-head paged attention with Triton kernels (see the module docstring)."""

    name = "kvc_triton"
    # the layer's rope kernel writes K/V to each head's own slot (``rope_and_cache`` with
    # per-head slots): forward then gets key = value = None
    fuses_rope = True
    # its prefill kernel picks the unified kernel's tile shapes (``unified_block_m``)
    prefill_variant_query_lens = staticmethod(prefill_variant_query_lens)

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
        t, hq, d = query.shape
        if key is not None:  # a caller that did not write them with the rotation
            assert value is not None
            write_head_kv(key, value, kv_cache[0].view(-1, d), kv_cache[1].view(-1, d),
                          metadata.slot_mapping, kv_scale)  # fmt: skip
        if kv_scale is None:
            return self._attend(query, kv_cache, metadata, scale, sliding_window)
        # an fp8 cache: q . (k s_k) = (q s_k) . k and sum p (v s_v) = s_v sum p v per KV head,
        # so the kernels read the stored codes (and score with the same logits)
        g = hq // kv_scale.shape[1]
        k_scale = kv_scale[0].repeat_interleave(g)[None, :, None]  # [1, Hq, 1]
        v_scale = kv_scale[1].repeat_interleave(g)[None, :, None]
        q = (query.float() * k_scale).to(query.dtype)
        out = self._attend(q, kv_cache, metadata, scale, sliding_window).view(t, hq, d)
        return (out.float() * v_scale).to(query.dtype).view(t, hq * d)

    def _attend(
        self,
        query: torch.Tensor,  # [T, Hq, d]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, d]; the step's K/V written
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        t, hq, d = query.shape
        info: KVCLayerInfo = metadata.kvc
        k_flat = kv_cache[0].view(-1, d)
        v_flat = kv_cache[1].view(-1, d)
        plan = info.plan
        scores = info.scores if info.compressible else None
        bs = metadata.block_size
        tables, lens = metadata.block_tables, metadata.seq_lens  # the cache's, every row
        by_position = sliding_window is not None and info.compressible
        if len(plan.prefill) == 0 and not by_position:  # decode-only step: one kernel
            out = kvc_decode_attention(
                query, kv_cache, tables, lens, scale, scores=scores,
                sliding_window=sliding_window, row_ids=info.row_ids, scored=info.scored,
            )  # fmt: skip
            return out.view(t, hq * d)
        tensors = plan.tensors
        qsl = metadata.query_start_loc_np
        assert qsl is not None
        # A mixed step: every kernel reads its query rows and writes its output rows of the
        # whole step in place, through the step's index tensors (``KVCStepPlan.tensors``, made
        # once for all layers), and the cache's whole tables through table-row indices.
        out = torch.empty_like(query)
        if len(plan.decode):
            rows, trows = tensors["decode_rows"], tensors["decode_table_rows"]
            if by_position:
                out[rows] = decode_attention(
                    query[rows], k_flat, v_flat, tables[trows], lens[trows], bs, scale,
                    sliding_window, scores, max_len=plan.bound(plan.decode, query.device),
                    positions=info.positions, q_pos=info.token_positions[rows],
                )  # fmt: skip
            else:
                kvc_decode_attention(
                    query, kv_cache, tables, lens, scale, scores=scores,
                    sliding_window=sliding_window, row_ids=trows, scored=info.scored,
                    q_rows=rows, out=out,
                )  # fmt: skip
        if len(plan.prefill) == 0:
            return out.view(t, hq * d)
        # verify rows (speculative decoding) keep their queries, scored next step
        stash = plan.stash if scores is not None else None
        if by_position:  # rare (every layer windowed): the torch path, by position
            for r in plan.prefill.tolist():
                a, b = int(qsl[r]), int(qsl[r + 1])
                row = int(plan.rows[r])
                out[a:b] = prefill_attention(
                    query[a:b], k_flat, v_flat, tables[row], lens[row], bs, scale,
                    sliding_window, scores, int(plan.collect[r]), plan.maxpool_kernel,
                    max_len=int(plan.max_lens[r]), positions=info.positions,
                )  # fmt: skip
            if stash is not None:  # (scored by the torch path too: by position)
                stash.keep(info.layer, query[tensors["stash_rows"]], None, scale, sliding_window)
            return out.view(t, hq * d)
        # chunks that end their prompts score their keys from their last queries' softmax
        # normalizers, which the prefill kernel stores beside its output (and the verify
        # rows' queries keep theirs for the next step)
        window = scores is not None and plan.window_max_len > 0
        lse = (
            torch.empty((t, hq), dtype=torch.float32, device=query.device)
            if window or stash is not None
            else None
        )
        kvc_paged_attention(
            query, kv_cache, tensors["prefill_qsl"], lens, tables, plan.prefill_max_q, scale,
            sliding_window, row_ids=tensors["prefill_table_rows"],
            q_start=tensors["prefill_q_start"], out=out,
            num_chunk_tokens=plan.prefill_tokens or t, lse=lse,
        )  # fmt: skip
        if stash is not None:
            assert lse is not None
            rows = tensors["stash_rows"]
            stash.keep(info.layer, query[rows], lse[rows], scale, sliding_window)
        if window:
            assert lse is not None
            kvc_window_scores(
                query, kv_cache, lse, tables, lens, tensors["window_reqs"],
                tensors["window_rows"], tensors["window_n"], scale, scores,
                plan.maxpool_kernel, plan.window_max_len,
            )  # fmt: skip
        return out.view(t, hq * d)


@torch.inference_mode()
def warm_up_decode_kernels(
    cache: HeadPagedCache, num_heads: int, dtype: torch.dtype, max_rows: int
) -> int:
    """Compile every variant of the decode kernels a step can meet, before the first request.

    A step's decode rows pick a split count from their number (``kvc_decode_num_splits``: one
    kernel variant per count, a constexpr), run with or without the score pass, and read their
    query rows directly (decode-only steps) or through ``q_rows`` (a mixed step's decode rows).
    CUDA graphs cover only decode-only steps; the rest would compile inside the first steps that
    meet them, in a timed run (Benchmark D counts the Triton compiles of its runs). Here
    each variant runs once on rows that point at the pad row (length 0 in every head: nothing
    is read or scored). ``num_heads``: the model's query heads. Returns the launches made.
    Example (132 SMs, 8 KV heads, 32k keys): 1 row -> 32 splits, 2 -> 16, 3-4 -> 8,
    5-8 -> 4, 9-16 -> 2, 17+ -> 1: six counts x (scored, unscored) x (direct, q_rows); with
    ``SKEW_SPLITS`` (the default), scored rows at 17+ split their long heads only, variants
    of their own."""
    h, d, dev = cache.num_kv_heads, cache.head_dim, cache.device
    tables, lens = cache.tables[:, :h], cache.lens[:, :h]  # [rows, H, W], [rows, H]
    kinds = {(w or 0, bool(c)) for w, c in zip(cache.windows, cache.spec.compressible)}
    launches = 0
    for window, compressible in sorted(kinds):
        if window and compressible:
            continue  # by position, in torch (see forward)
        first_rows: dict[int, int] = {}  # split count -> the fewest rows that give it
        for n in range(1, max_rows + 1):
            s = kvc_decode_auto_splits(n, tables, cache.block_size, window, d, dev)
            first_rows.setdefault(s, n)
            if s == 1:
                break
        for n in first_rows.values():
            query = torch.zeros((n, num_heads, d), dtype=dtype, device=dev)
            row_ids = torch.full((n,), cache.pad_row, dtype=torch.int64, device=dev)
            q_rows = torch.arange(n, device=dev)
            for scores in (cache.scores, None) if compressible else (None,):
                for rows in (None, q_rows):
                    kvc_decode_attention(
                        query, cache.kv, tables, lens, 1.0, scores=scores,
                        sliding_window=window or None, row_ids=row_ids, scored=cache.scored,
                        q_rows=rows, out=torch.empty_like(query),
                    )  # fmt: skip
                    launches += 1
    return launches
