"""Decode context parallelism's attention (``pagedllm/attention/dcp.py``), one process: D
ranks' shares of a paged cache, written through ``kv_layout.dcp_slot_mapping``, each attended
by ``attend_local``, merged by their log-sum-exp, equal dense causal attention over every
token - for prefill chunks after cached tokens, decodes, multi-token rows, sliding windows,
GQA and an fp8 cache; and the slot arithmetic on a worked example. The Triton kernels of the
GPU path equal that reference (in the interpreter on a CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.triton_setup import CUDA, DEVICE

# isort: split

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

CPU = torch.device("cpu")


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


def _shares(size: int, window: int | None, fp8: bool, device: torch.device = CPU,
            dtype: torch.dtype = torch.float32) -> dict:  # fmt: skip
    """D ranks' caches of one batch, written through their DCP slots, and their metadata:
    a first chunk, a chunk after 9 cached tokens, a decode at position 0 (a rank may hold no
    key of a row), a decode, a 4-token row (speculative decoding)."""
    torch.manual_seed(0)
    bs, kvh, heads, d, num_blocks = 4 * size, 1, 3 * size, 16, 40  # bs: the scheduler's block
    reqs = [(7, 7), (20, 11), (1, 1), (33, 1), (26, 4)]  # (seq_len, query_len)
    rng = np.random.default_rng(0)
    max_blocks = max(-(-s // bs) for s, _ in reqs)
    tables = rng.permutation(num_blocks)[: len(reqs) * max_blocks].reshape(len(reqs), -1)
    keys = [torch.randn(s, kvh, d).to(device, dtype) for s, _ in reqs]
    vals = [torch.randn(s, kvh, d).to(device, dtype) for s, _ in reqs]
    kv_scale = torch.tensor([[0.02], [0.015]], device=device) if fp8 else None
    q_lens = np.array([q for _, q in reqs])
    seq_lens = np.array([s for s, _ in reqs])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    query = torch.randn(int(qsl[-1]), heads, d).to(device, dtype)
    ranks = []
    for rank in range(size):
        cache = torch.zeros(2, num_blocks, bs // size, kvh, d, dtype=FP8 if fp8 else dtype,
                            device=device)  # fmt: skip
        for i, (s, _) in enumerate(reqs):  # every position, through this rank's slots
            slots = dcp_slot_mapping(tables[None], np.full(s, i), np.arange(s), bs, rank, size)
            write_kv_ref(keys[i], vals[i], cache, torch.from_numpy(slots[0]).to(device), kv_scale)
        md = AttentionMetadata(
            num_reqs=len(reqs),
            num_actual_tokens=int(qsl[-1]),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            slot_mapping=torch.zeros(0, dtype=torch.int64),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(device),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs // size,
            query_start_loc_np=qsl,
            seq_lens_np=seq_lens,
            dcp=(rank, size),
        )
        ranks.append((cache, md))
    return dict(reqs=reqs, keys=keys, vals=vals, kv_scale=kv_scale, qsl=qsl, query=query,
                ranks=ranks)  # fmt: skip


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
def test_shares_merge_to_full_attention(size: int, window: int | None, fp8: bool) -> None:
    b = _shares(size, window, fp8)
    query, qsl, kv_scale = b["query"], b["qsl"], b["kv_scale"]
    outs, lses = zip(*(attend_local(query, c, md, 0.25, window, kv_scale) for c, md in b["ranks"]))
    lse = torch.stack(lses)  # [D, N, H]
    weight = torch.exp(lse - torch.logsumexp(lse, 0)).nan_to_num(0.0)
    merged = (torch.stack(outs) * weight[..., None]).sum(0)  # [N, H, d]
    assert torch.isfinite(merged).all()
    for i, (s, q) in enumerate(b["reqs"]):
        k, v = b["keys"][i], b["vals"][i]
        if fp8:  # what the cache holds
            k = dequantize(quantize_fp8(k, kv_scale[0]), kv_scale[0], torch.float32)
            v = dequantize(quantize_fp8(v, kv_scale[1]), kv_scale[1], torch.float32)
        a, e = int(qsl[i]), int(qsl[i + 1])
        want = _dense(query[a:e], k, v, torch.arange(s - q, s), 0.25, window)
        torch.testing.assert_close(merged[a:e], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("size", "window", "fp8"), [(2, None, False), (4, 5, False), (2, 5, True), (4, None, True)]
)
def test_triton_kernels_equal_the_reference(size: int, window: int | None, fp8: bool) -> None:
    """The GPU path (``ops/dcp_attention.py``): each rank's output and lse equal
    ``attend_local``'s, and the fused weights equal the formula; bfloat16 on a GPU, float32
    in the interpreter."""
    from pagedllm.ops.dcp_attention import dcp_combine, dcp_paged_attention

    dtype = torch.bfloat16 if CUDA else torch.float32
    b = _shares(size, window, fp8, DEVICE, dtype)
    query, kv_scale = b["query"], b["kv_scale"]
    outs, lses = [], []
    for cache, md in b["ranks"]:
        want_o, want_l = attend_local(query, cache, md, 0.25, window, kv_scale)
        rank, _ = md.dcp
        got_o, got_l = dcp_paged_attention(
            query, cache, md.query_start_loc, md.seq_lens, md.block_tables, md.max_query_len,
            rank, size, 0.25, window, kv_scale,
        )  # fmt: skip
        tol = {"atol": 2e-2, "rtol": 2e-2} if CUDA else {"atol": 1e-4, "rtol": 1e-4}
        torch.testing.assert_close(got_o, want_o, **tol)
        assert torch.equal(torch.isinf(got_l), torch.isinf(want_l))
        finite = torch.isfinite(want_l)
        torch.testing.assert_close(got_l[finite], want_l[finite], **tol)
        outs.append(got_o)
        lses.append(got_l)
    lse_all = torch.stack(lses)  # [D, N, D * H]: every rank's
    n, group_heads, d = outs[0].shape
    for rank in range(size):
        got = dcp_combine(outs[rank], lse_all, rank)  # [D, N, H, d]
        w = torch.exp(lse_all[rank] - torch.logsumexp(lse_all, 0)).nan_to_num(0.0)
        want = (outs[rank] * w[..., None]).view(n, size, group_heads // size, d).transpose(0, 1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
