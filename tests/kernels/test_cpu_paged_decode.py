"""The compiled CPU decode attention (``pagedllm/ops/cpu``) against its PyTorch reference on
random inputs: GQA and MHA, float32 and bfloat16, ragged contexts over scattered blocks,
sliding windows; and the backend's decode rows use it when it is built.

Where a C++ compiler and ninja are present (CI, this machine) the kernel must build; without
them the backend's fallback is the PyTorch path (tested by every model test).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.nn import functional as F

from pagedllm.ops.cpu import cpu_ops


def _ext():  # noqa: ANN202
    ext = cpu_ops()
    if ext is None:
        if shutil.which("c++") and shutil.which("ninja"):
            pytest.fail("a compiler and ninja are here, but the CPU kernels did not build")
        pytest.skip("no C++ toolchain: the PyTorch path is used")
    return ext


def _reference(q, k_cache, v_cache, tables, lens, scale, window):  # noqa: ANN001, ANN202
    """Gather each request's keys from its blocks, then SDPA (float32)."""
    bs = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        n = int(lens[b])
        first = max(0, n - window) if window > 0 else 0
        pos = torch.arange(first, n)
        blocks = tables[b, pos // bs].long()
        k = k_cache[blocks, pos % bs].float()  # [n, KVH, D]
        v = v_cache[blocks, pos % bs].float()
        o = F.scaled_dot_product_attention(
            q[b].float()[:, None], k.transpose(0, 1), v.transpose(0, 1), scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        out[b] = o[:, 0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# float32 loops: AVX-512 for head sizes that are multiples of 16 (40: the plain loops), AVX2
# for multiples of 8 (80 and 40: their 8-lane tails), the plain loops elsewhere (36)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [(8, 2, 64), (4, 4, 32), (6, 1, 80), (4, 2, 40), (4, 2, 36)],
)
@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("sharp", [False, True], ids=["", "sharp"])
@pytest.mark.parametrize("allow_amx", [True, False], ids=["", "no-amx"])
def test_matches_reference(dtype, heads: int, kv_heads: int, head_dim: int, window: int,  # noqa: ANN001
                           sharp: bool, allow_amx: bool) -> None:  # fmt: skip
    """sharp: scores 30x larger, so most exponentials fall far below -87 (clamped). no-amx:
    the AVX-512 path on a CPU with AMX too (where the AMX one would run)."""
    ext = _ext()
    g = torch.Generator().manual_seed(heads * 100 + head_dim + window)
    bs, num_blocks, B = 16, 64, 7
    lens = torch.tensor([1, 5, 16, 17, 40, 100, 33], dtype=torch.int32)
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    # each request's blocks: distinct, scattered over the pool
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: B * 8].view(B, 8).to(torch.int32)
    q = torch.randn(B, heads, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5 * (30 if sharp else 1)
    got = ext.paged_decode(q, k_cache, v_cache, tables, lens, scale, window, allow_amx)
    want = _reference(q, k_cache, v_cache, tables, lens, scale, window)
    # bf16: output rounding; sharp fp32: a peaked softmax's sums in another order than SDPA's
    # (2e-5 with std::exp too)
    tol = (1e-4 if sharp else 1e-5) if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "bs"),
    [
        (9, 3, 64, 16),  # SmolLM2: the AMX path where the CPU has it (G 3, two tiles of dims)
        (16, 8, 128, 16),  # G 2, four tiles of dims (the most the AMX path takes)
        (32, 2, 64, 16),  # G 16, the widest score tile
        (34, 2, 64, 16),  # G 17: beyond a tile, the AVX-512 path
        (4, 1, 256, 16),  # D 256 (Gemma 3): beyond the AMX path
        (9, 3, 64, 32),  # blocks of 32: the AVX-512 path
    ],
)
@pytest.mark.parametrize("allow_amx", [True, False], ids=["", "no-amx"])
def test_amx_shapes_match_reference(dtype, heads: int, kv_heads: int, head_dim: int,  # noqa: ANN001
                                    bs: int, allow_amx: bool) -> None:  # fmt: skip
    """The shapes at the edges of the bfloat16 AMX path (and past them) against the
    reference: partial first and last blocks (a window), a one-key context, long contexts."""
    ext = _ext()
    g = torch.Generator().manual_seed(heads + head_dim + bs)
    B = 5
    lens = torch.tensor([1, 15, 16, 70, 131], dtype=torch.int32)
    per = -(-131 // bs)
    num_blocks = B * per + 3
    k_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: B * per].view(B, per).to(torch.int32)
    q = torch.randn(B, heads, head_dim, generator=g).to(dtype)
    for window in (0, 37):
        got = ext.paged_decode(q, k_cache, v_cache, tables, lens, head_dim**-0.5, window, allow_amx)
        want = _reference(q, k_cache, v_cache, tables, lens, head_dim**-0.5, window)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 40)])
def test_fp8_cache_matches_reference(dtype, heads: int, kv_heads: int, head_dim: int) -> None:  # noqa: ANN001
    """An fp8 cache (its bytes through the kernel's table, times each KV head's K and V
    scales) against the reference over the dequantized cache; every e4m3 byte but NaN's
    decodes as torch does; a missing or mis-shaped kv_scale is refused."""
    from pagedllm.kv_layout import FP8, dequantize

    ext = _ext()
    g = torch.Generator().manual_seed(heads + head_dim)
    bs, num_blocks, B = 16, 48, 5
    lens = torch.tensor([1, 15, 16, 70, 100], dtype=torch.int32)
    kv_scale = torch.rand(2, kv_heads, generator=g) + 0.05
    k8 = (torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g) * 40).to(FP8)
    v8 = (torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g) * 40).to(FP8)
    tables = torch.randperm(num_blocks, generator=g)[: B * 7].view(B, 7).to(torch.int32)
    q = torch.randn(B, heads, head_dim, generator=g).to(dtype)
    k = dequantize(k8, kv_scale[0], torch.float32)
    v = dequantize(v8, kv_scale[1], torch.float32)
    for window in (0, 20):
        got = ext.paged_decode(q, k8, v8, tables, lens, head_dim**-0.5, window,
                               kv_scale=kv_scale)  # fmt: skip
        want = _reference(q, k, v, tables, lens, head_dim**-0.5, window)
        # (float32: scores up to ~50, a peaked softmax summed in another order than SDPA's,
        # as in the sharp case above; values up to ~140, so an output that cancels to near
        # zero carries their rounding: the absolute tolerance scales with them - the
        # AVX-512 loops' 16-lane sums land 1.9e-4 from the reference here, 1.3e-6 of max |v|)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        atol = max(tol, 5e-6 * float(v.abs().max())) if dtype == torch.float32 else tol
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=tol)
    # the table: every byte (but the two NaNs) as torch decodes it, through a one-key context
    every = torch.arange(256, dtype=torch.uint8)
    every = every[(every != 0x7F) & (every != 0xFF)].view(FP8)  # [254]
    kc = torch.zeros(1, bs, 1, 254, dtype=FP8)
    vc = torch.zeros(1, bs, 1, 254, dtype=FP8)
    vc[0, 0, 0] = every
    ones = torch.ones(2, 1)
    got = ext.paged_decode(torch.zeros(1, 1, 254), kc, vc, torch.zeros(1, 1, dtype=torch.int32),
                           torch.ones(1, dtype=torch.int32), 1.0, 0, kv_scale=ones)  # fmt: skip
    assert torch.equal(got[0, 0], every.float())
    with pytest.raises(RuntimeError, match="kv_scale"):
        ext.paged_decode(q.float(), k8, v8, tables, lens, 1.0, 0)


def test_amx_path_where_the_cpu_has_it() -> None:
    """On a Linux CPU with AMX-BF16 the kernel was built with its AMX path and may use it."""
    ext = _ext()
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if "amx_bf16" not in flags:
        assert not ext.amx_decode()
        return
    assert ext.amx_decode()


def test_backend_decode_uses_the_kernel_and_agrees(monkeypatch) -> None:  # noqa: ANN001
    """The CPU backend's decode rows: the same output with the kernel (the default for float32
    and bfloat16 caches) as with the PyTorch path (``PAGEDLLM_CPU_KERNELS=0``), and the kernel
    really ran."""
    import numpy as np

    from pagedllm.attention.backends import torch_native
    from pagedllm.attention.metadata import AttentionMetadata

    ext = _ext()
    g = torch.Generator().manual_seed(0)
    bs, num_blocks, H, KVH, D = 16, 32, 4, 2, 32
    kv = torch.randn(2, num_blocks, bs, KVH, D, generator=g)
    lens = np.array([9, 30, 17], dtype=np.int64)
    tables = np.array([[3, 7, 0], [1, 2, 5], [9, 4, 0]], dtype=np.int32)
    q = torch.randn(3, H, D, generator=g)
    k, v = torch.randn(3, KVH, D, generator=g), torch.randn(3, KVH, D, generator=g)
    slots = torch.from_numpy(tables[np.arange(3), (lens - 1) // bs].astype(np.int64) * bs
                             + (lens - 1) % bs)  # fmt: skip

    def md() -> AttentionMetadata:
        qsl = np.arange(4)
        m = AttentionMetadata(
            num_reqs=3,
            num_actual_tokens=3,
            query_start_loc=torch.from_numpy(qsl),
            seq_lens=torch.from_numpy(lens),
            slot_mapping=slots,
            block_tables=torch.from_numpy(tables),
            max_query_len=1,
            max_seq_len=30,
            block_size=bs,
            query_start_loc_np=qsl,
            seq_lens_np=lens,
        )
        m.plan["block_tables_np"] = tables
        return m

    monkeypatch.delenv("PAGEDLLM_CPU_KERNELS", raising=False)
    assert torch_native._decode_kernel(torch.float32) is ext  # by default: the kernel
    assert torch_native._decode_kernel(torch.bfloat16) is ext
    assert torch_native._decode_kernel(torch.float16) is None  # the kernel has no float16
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "1")
    assert torch_native._decode_kernel(torch.float16) is None
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    assert torch_native._decode_kernel(torch.float32) is None
    assert torch_native._decode_kernel(torch.bfloat16) is None
    calls = []
    real = ext.paged_decode
    monkeypatch.setattr(torch_native, "_decode_kernel", lambda dtype=None: _Spy(real, calls))
    backend = torch_native.TorchNativeBackend()
    got = backend.forward(q, k, v, kv.clone(), md(), D**-0.5, None)
    monkeypatch.setattr(torch_native, "_decode_kernel", lambda dtype=None: None)
    want = backend.forward(q, k, v, kv.clone(), md(), D**-0.5, None)
    assert calls, "the kernel did not run"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class _Spy:
    def __init__(self, fn, calls: list) -> None:  # noqa: ANN001
        self.fn, self.calls = fn, calls

    def paged_decode(self, *args):  # noqa: ANN002, ANN202
        self.calls.append(1)
        return self.fn(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_equals_torch(dtype: torch.dtype) -> None:
    """The compiled argmax (greedy sampling on the CPU) gives torch.argmax's indices: random
    rows, ties (the first), rows of -inf, NaN (the first NaN), +inf, a non-contiguous view;
    and ``pagedllm.ops.cpu.argmax`` routes to it once built."""
    from pagedllm.ops.cpu import argmax

    ext = _ext()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 5000, generator=g).to(dtype)
    y = torch.zeros(6, 300, dtype=dtype)
    y[0, 10] = y[0, 20] = 2.0  # tie
    y[1] = float("-inf")
    y[2, 3], y[2, 7], y[2, 9] = 5.0, float("nan"), float("nan")
    y[3, 100] = y[3, 200] = float("inf")
    y[4, 299] = 1.0
    y[5] = torch.arange(300, 0, -1).to(dtype)  # the first element
    for t in (x, y, x[:, ::3], x[:, :1]):
        assert torch.equal(ext.argmax_last(t), t.argmax(-1))
        assert torch.equal(argmax(t), t.argmax(-1))
