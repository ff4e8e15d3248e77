"""The compiled CPU prefill attention (``paged_prefill`` of ``pagedllm/ops/cpu``: bfloat16, AMX
tiles or VDPBF16PS) against a float32 reference on random inputs: chunks with and without
cached context, ragged lengths over scattered blocks, GQA and MHA, head sizes 32 / 64 / 96 /
128, block sizes 16 / 32 / 8, sliding windows; and the attention backend's prefill rows through
it agree with SDPA's. Where the CPU has no AVX512-BF16 the kernel must say so (False) and write
nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from tests.kernels.test_cpu_paged_decode import _ext


def _bf16_cpu() -> bool:
    """Whether this CPU has AVX512-BF16 (the kernel's build is -march=native)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in text and "avx512bw" in text


def _reference(q, k_cache, v_cache, starts, q_lens, lens, tables, scale, window):  # noqa: ANN001, ANN202
    """Each request's keys gathered from its blocks, then masked SDPA in float32."""
    bs = k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for r in range(len(starts)):
        n, ql, s = int(lens[r]), int(q_lens[r]), int(starts[r])
        pos = torch.arange(n)
        blocks = tables[r, pos // bs].long()
        k = k_cache[blocks, pos % bs].float().transpose(0, 1)  # [KVH, n, D]
        v = v_cache[blocks, pos % bs].float().transpose(0, 1)
        q_pos = torch.arange(n - ql, n)
        vis = pos[None, :] <= q_pos[:, None]
        if window > 0:
            vis &= pos[None, :] > q_pos[:, None] - window
        o = F.scaled_dot_product_attention(
            q[s : s + ql].float().transpose(0, 1), k, v, attn_mask=vis, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        out[s : s + ql] = o.transpose(0, 1)
    return out


def _case(heads, kv_heads, head_dim, bs, q_lens, ctxs, seed, dtype=torch.bfloat16):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(seed)
    lens = [c + q for c, q in zip(ctxs, q_lens)]
    need = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    used = 0
    for r, m in enumerate(need):  # each request's blocks scattered over the pool
        tables[r, :m] = perm[used : used + m]
        used += m
    # a query tensor with gaps between rows ([T, H + 2 KVH, D] sliced), as the model's q is
    qkv = torch.randn(sum(q_lens), heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    q = qkv[:, :heads]
    starts = torch.tensor(np.cumsum([0, *q_lens[:-1]]), dtype=torch.int64)
    return (
        q, k_cache, v_cache, starts, torch.tensor(q_lens, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), tables,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 128), (6, 2, 96)]
)
@pytest.mark.parametrize("bs", [16, 32, 8])
@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("sharp", [False, True], ids=["", "sharp"])
@pytest.mark.parametrize("allow_amx", [True, False], ids=["", "no-amx"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_reference(heads: int, kv_heads: int, head_dim: int, bs: int, window: int,
                           sharp: bool, allow_amx: bool, dtype: torch.dtype) -> None:  # fmt: skip
    """Requests: a first chunk of 1 row past a 16-row group (17), a first chunk of 40, a chunk
    of 33 after 100 cached keys, a chunk of 5 after 7, one of 64 after 31. sharp: scores 30x
    larger (most exponentials underflow). no-amx: the VDPBF16PS path where AMX is there too
    (float32 has one path: AVX-512 FMAs)."""
    if dtype == torch.float32 and not allow_amx:
        pytest.skip("float32 has no AMX path to turn off")
    ext = _ext()
    if not _bf16_cpu():
        pytest.skip("no AVX512-BF16 here: paged_prefill declines (tested below)")
    q_lens, ctxs = [17, 40, 33, 5, 64], [0, 0, 100, 7, 31]
    args = _case(heads, kv_heads, head_dim, bs, q_lens, ctxs, heads * 7 + bs + window, dtype)
    q, k_cache, v_cache, starts, ql, lens, tables = args
    scale = head_dim**-0.5 * (30 if sharp else 1)
    out = torch.full((q.shape[0], heads, head_dim), float("nan"), dtype=dtype)
    assert ext.paged_prefill(
        q, k_cache, v_cache, starts, ql, lens, tables, scale, window, out, allow_amx
    )
    want = _reference(q, k_cache, v_cache, starts, ql, lens, tables, scale, window)
    # bfloat16: P rounded to bfloat16 before the products, the output rounded to bfloat16;
    # float32: sums in another order than SDPA's, a polynomial exponential
    tol = 2e-2 if dtype == torch.bfloat16 else (1e-4 if sharp else 1e-5)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_declines_other_dtypes_and_head_sizes() -> None:
    """float16, a bfloat16 head size that is not a multiple of 32 (40), a float32 one not of 16
    (24): False and `out` untouched; float32 at 48 runs; on a CPU without AVX512-BF16: False
    for all."""
    ext = _ext()
    q, k_cache, v_cache, starts, ql, lens, tables = _case(4, 2, 64, 16, [20], [3], 0)
    out = torch.zeros(q.shape[0], 4, 64, dtype=torch.float16)
    assert not ext.paged_prefill(
        q.half(), k_cache.half(), v_cache.half(), starts, ql, lens, tables, 0.1, 0, out
    )
    assert out.abs().sum() == 0
    q2, k2, v2, *_ = _case(4, 2, 40, 16, [20], [3], 0)
    out2 = torch.zeros(q2.shape[0], 4, 40, dtype=torch.bfloat16)
    assert not ext.paged_prefill(q2, k2, v2, starts, ql, lens, tables, 0.1, 0, out2)
    assert out2.abs().sum() == 0
    q3, k3, v3, *_ = _case(4, 2, 24, 16, [20], [3], 0, torch.float32)
    out3 = torch.zeros(q3.shape[0], 4, 24)
    assert not ext.paged_prefill(q3, k3, v3, starts, ql, lens, tables, 0.1, 0, out3)
    q4, k4, v4, *_ = _case(4, 2, 48, 16, [20], [3], 0, torch.float32)
    out4 = torch.zeros(q4.shape[0], 4, 48)
    assert ext.paged_prefill(q4, k4, v4, starts, ql, lens, tables, 0.1, 0, out4) == _bf16_cpu()
    out5 = torch.zeros(q.shape[0], 4, 64, dtype=torch.bfloat16)
    ran = ext.paged_prefill(q, k_cache, v_cache, starts, ql, lens, tables, 0.1, 0, out5)
    assert ran == _bf16_cpu()


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backend_prefill_rows_use_the_kernel_and_agree(monkeypatch, window, dtype) -> None:  # noqa: ANN001
    """A step of two decode rows and three prefill chunks (a first chunk, one after
    cached keys, one of 2 rows) through the CPU backend: the kernel ran for the chunks and the
    output agrees with the SDPA path's (``PAGEDLLM_CPU_KERNELS=0``) on every row."""
    from pagedllm.attention.backends import torch_native
    from pagedllm.attention.metadata import AttentionMetadata

    ext = _ext()
    if not _bf16_cpu():
        pytest.skip("no AVX512-BF16 here: the SDPA path is all there is")
    g = torch.Generator().manual_seed(1)
    bs, num_blocks, H, KVH, D = 16, 40, 6, 2, 64
    q_lens = np.array([1, 37, 1, 20, 2], dtype=np.int64)
    lens = np.array([30, 37, 9, 70, 18], dtype=np.int64)
    perm = torch.randperm(num_blocks, generator=g).numpy().astype(np.int32)
    tables = perm[:35].reshape(5, 7)
    kv = torch.randn(2, num_blocks, bs, KVH, D, generator=g).to(dtype)
    T = int(q_lens.sum())
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k, v = torch.randn(T, KVH, D, generator=g).to(dtype), torch.randn(T, KVH, D).to(dtype)
    pos = np.concatenate([np.arange(n - m, n) for m, n in zip(q_lens, lens)])
    req = np.repeat(np.arange(5), q_lens)
    slots = torch.from_numpy(tables[req, pos // bs].astype(np.int64) * bs + pos % bs)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])

    def md() -> AttentionMetadata:
        m = AttentionMetadata(
            num_reqs=5,
            num_actual_tokens=T,
            query_start_loc=torch.from_numpy(qsl),
            seq_lens=torch.from_numpy(lens),
            slot_mapping=slots,
            block_tables=torch.from_numpy(tables),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(lens.max()),
            block_size=bs,
            query_start_loc_np=qsl,
            seq_lens_np=lens,
        )
        m.plan["block_tables_np"] = tables
        return m

    calls = []

    class Spy:
        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(ext, name)

        def paged_prefill(self, *args):  # noqa: ANN002, ANN202
            calls.append(1)
            return ext.paged_prefill(*args)

    monkeypatch.setattr(torch_native, "_decode_kernel", lambda dtype=None: Spy())
    backend = torch_native.TorchNativeBackend()
    got = backend.forward(q, k, v, kv.clone(), md(), D**-0.5, window)
    assert calls, "the prefill kernel did not run"
    monkeypatch.setattr(torch_native, "_decode_kernel", lambda dtype=None: None)
    want = backend.forward(q, k, v, kv.clone(), md(), D**-0.5, window)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
