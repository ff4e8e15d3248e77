"""Decode context parallelism's attention (``pagedllm/attention/dcp.py``), one process: D
ranks' shares of a paged cache, written through ``kv_layout.dcp_slot_mapping``, each attended
by ``attend_local``, merged by their log-sum-exp, equal dense causal attention over every
token - for prefill chunks after cached tokens, decodes, multi-token rows, sliding windows,
GQA and an fp8 cache; and the slot arithmetic on a worked example."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.dcp import attend_local
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv_layout import (
    FP8,
    dcp_local_lens,
    dcp_slot_mapping,
    dequantize,
    quantize_fp8,
    write_kv_ref,
)


def test_slots_worked_example() -> None:
    tables = np.array([[[7, 3]]])  # [G, rows, blocks]: one request, blocks 7 and 3
    pos = np.arange(8)
    rows = np.zeros(8, dtype=np.int64)
    # bs 4 over 2 ranks: pages of 2; rank 0 holds 0, 2 in block 7 and 4, 6 in block 3
    assert dcp_slot_mapping(tables, rows, pos, 4, 0, 2)[0].tolist() == [
        14, -1, 15, -1, 6, -1, 7, -1,
    ]  # fmt: skip
    assert dcp_slot_mapping(tables, rows, pos, 4, 1, 2)[0].tolist() == [
        -1, 14, -1, 15, -1, 6, -1, 7,
    ]  # fmt: skip
    assert dcp_local_lens(np.array([0, 1, 4, 5]), 1, 2).tolist() == [0, 0, 2, 2]
    assert dcp_local_lens(np.array([0, 1, 4, 5]), 0, 2).tolist() == [0, 1, 2, 3]


def _dense(q, k, v, q_pos, scale, window):  # noqa: ANN001, ANN202
    # q [Q, H, d], k/v [S, kvh, d] of one request -> [Q, H, d]
    heads, kvh = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kvh, 1).transpose(0, 1)  # [H, S, d]
    v = v.repeat_interleave(heads // kvh, 1).transpose(0, 1)
    s = q.transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, Q, S]
    k_pos = torch.arange(k.shape[1])
    vis = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        vis &= k_pos[None, :] > q_pos[:, None] - window
    return (s.masked_fill(~vis, float("-inf")).softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
def test_shares_merge_to_full_attention(size: int, window: int | None, fp8: bool) -> None:
    torch.manual_seed(0)
    bs, kvh, heads, d, num_blocks = 4 * size, 1, 6, 16, 40  # bs: the scheduler's block
    # (seq_len, query_len): a first chunk, a chunk after 9 cached, a decode at position 0
    # (a rank may hold no key of a row), a decode, a 4-token row (speculative decoding)
    reqs = [(7, 7), (20, 11), (1, 1), (33, 1), (26, 4)]
    rng = np.random.default_rng(0)
    max_blocks = max(-(-s // bs) for s, _ in reqs)
    tables = rng.permutation(num_blocks)[: len(reqs) * max_blocks].reshape(len(reqs), -1)
    keys = [torch.randn(s, kvh, d) for s, _ in reqs]
    vals = [torch.randn(s, kvh, d) for s, _ in reqs]
    dtype = FP8 if fp8 else torch.float32
    kv_scale = torch.tensor([[0.02], [0.015]]) if fp8 else None
    q_lens = np.array([q for _, q in reqs])
    seq_lens = np.array([s for s, _ in reqs])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    query = torch.randn(int(qsl[-1]), heads, d)
    outs, lses = [], []
    for rank in range(size):
        cache = torch.zeros(2, num_blocks, bs // size, kvh, d, dtype=dtype)
        for i, (s, _) in enumerate(reqs):  # every position, through this rank's slots
            slots = dcp_slot_mapping(tables[None], np.full(s, i), np.arange(s), bs, rank, size)
            write_kv_ref(keys[i], vals[i], cache, torch.from_numpy(slots[0]), kv_scale)
        md = AttentionMetadata(
            num_reqs=len(reqs),
            num_actual_tokens=int(qsl[-1]),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            slot_mapping=torch.zeros(0, dtype=torch.int64),
            block_tables=torch.from_numpy(tables.astype(np.int32)),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs // size,
            query_start_loc_np=qsl,
            seq_lens_np=seq_lens,
            dcp=(rank, size),
        )
        o, lse = attend_local(query, cache, md, 0.25, window, kv_scale)
        outs.append(o)
        lses.append(lse)
    lse = torch.stack(lses)  # [D, N, H]
    weight = torch.exp(lse - torch.logsumexp(lse, 0)).nan_to_num(0.0)
    merged = (torch.stack(outs) * weight[..., None]).sum(0)  # [N, H, d]
    assert torch.isfinite(merged).all()
    for i, (s, q) in enumerate(reqs):
        k, v = keys[i], vals[i]
        if fp8:  # what the cache holds
            k = dequantize(quantize_fp8(k, kv_scale[0]), kv_scale[0], torch.float32)
            v = dequantize(quantize_fp8(v, kv_scale[1]), kv_scale[1], torch.float32)
        a, b = int(qsl[i]), int(qsl[i + 1])
        want = _dense(query[a:b], k, v, torch.arange(s - q, s), 0.25, window)
        torch.testing.assert_close(merged[a:b], want, atol=1e-5, rtol=1e-5)
