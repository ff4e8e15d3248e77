"""fp8 KV caches (``--kv-cache-dtype fp8``): every write path quantizes as the reference does
(``kv_layout.quantize_fp8``), every read path attends over fp8 * scale as the reference does.

The Triton kernels run through the interpreter on a CPU (small shapes), on the GPU itself
where there is one. Writes are compared code by code (see ``_close_fp8`` for the
interpreter's one conversion bug); reads of the same cache as tightly as 16-bit caches are.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import CUDA, DEVICE

# isort: split

from pagedllm.attention.backends.torch_native import TorchNativeBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv_layout import (
    FP8,
    calibrate_scales,
    dequantize,
    quantize_fp8,
    write_kv_ref,
)
from pagedllm.ops.kv_write import write_kv_cache
from pagedllm.ops.paged_attention import paged_attention, paged_attention_ref
from pagedllm.ops.rotary import rope, rope_and_cache
from tests.kernels.test_paged_attention import TOL, make_batch


def _scales(num_kv_heads: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(2, num_kv_heads, generator=gen) * 0.5 + 0.01).to(DEVICE)  # [2, kvh]


def _close_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """The reference's fp8 codes, but for a rare one a rounding step away (the kernel
    divides by the scale approximately). Triton's interpreter converts a value that rounds
    up into the next power of two without the carry (7.92 -> 4, not 8): accepted there."""
    g, w = got.float().cpu(), want.float().cpu()
    assert torch.isfinite(g).all()
    exact = g == w
    if not CUDA:
        exact |= (2 * g == w) & (w != 0)
    step = (g - w).abs() <= w.abs() / 8 + 2.0**-9
    assert (exact | step).all()
    assert exact.float().mean() > 0.99


def test_quantize_reference() -> None:
    """fp8(clamp(x / s)) per KV head: values past 448 * s clip, the rest read back within
    the e4m3 step; dequantize multiplies back; calibration sets max / 200 and max / 100."""
    x = torch.randn(50, 3, 16) * torch.tensor([1.0, 30.0, 0.01])[None, :, None]
    x[0, 0, 0] = 1e4  # far past 448 * scale: clips
    scale = torch.tensor([0.05, 1.0, 1e-4])
    q = quantize_fp8(x, scale)
    assert q.dtype == FP8 and q.shape == x.shape
    back = dequantize(q, scale, torch.float32)
    assert back[0, 0, 0] == 448 * 0.05
    err = (back - x).abs()[1:]
    assert (err <= x.abs()[1:] / 16 + 2.0**-9 * scale[None, :, None]).all()
    kv_scale = torch.zeros(2, 3)
    calibrate_scales(kv_scale, x, x * 2)
    amax = x.abs().amax(dim=(0, 2))
    torch.testing.assert_close(kv_scale[0], amax / 200)
    torch.testing.assert_close(kv_scale[1], 2 * amax / 100)
    # a head of zeros keeps a positive scale (no division by zero at the write)
    calibrate_scales(kv_scale, torch.zeros(4, 3, 16), torch.zeros(4, 3, 16))
    assert (kv_scale > 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_cache_fp8(dtype: torch.dtype) -> None:
    """The Triton KV write quantizes as write_kv_ref does; slot -1 and tokens past the slot
    list are not written."""
    kvh, d, bs, nb = 2, 32, 16, 6
    gen = torch.Generator().manual_seed(0)
    key = (torch.randn(9, kvh, d, generator=gen) * 3).to(dtype).to(DEVICE)
    value = torch.randn(9, kvh, d, generator=gen).to(dtype).to(DEVICE)
    slots = torch.tensor([5, 17, -1, 40, 63, 2, 90, 91], device=DEVICE)  # 8 of 9 tokens
    kv_scale = _scales(kvh, 1)
    got = torch.zeros(2, nb, bs, kvh, d, dtype=FP8, device=DEVICE)
    want = torch.zeros_like(got)
    write_kv_cache(key, value, got, slots, kv_scale)
    write_kv_ref(key, value, want, slots, kv_scale)
    _close_fp8(got, want)
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[[5, 17, 40, 63, 2, 90, 91]] = False
    assert (got.view(2, nb * bs, -1)[:, untouched.to(DEVICE)].float() == 0).all()
    with pytest.raises(ValueError, match="kv_scale"):  # an fp8 cache is never written unscaled
        write_kv_cache(key, value, got, slots)


@pytest.mark.parametrize("norm", [False, True])
def test_rope_and_cache_fp8(norm: bool) -> None:
    """The fused rotary kernel writes rotate(norm(k)) and v into an fp8 cache as
    rope + write_kv_ref do."""
    t, h, kvh, d, bs = 7, 4, 2, 32, 16
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(t, h, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    k = (torch.randn(t, kvh, d, generator=gen) * 4).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(t, kvh, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    pos = torch.tensor([0, 3, 9, 10, 30, 31, 2], device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(64).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)  # [64, d]
    w = (torch.rand(d, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE) if norm else None
    slots = torch.tensor([1, 20, 33, -1, 4, 50, 60], device=DEVICE)
    kv_scale = _scales(kvh, 3)
    got = torch.zeros(2, 4, bs, kvh, d, dtype=FP8, device=DEVICE)
    q_got = rope_and_cache(pos, q, k, v, cos_sin, got, slots, w, w, kv_scale=kv_scale)
    q_want, k_rot = rope(pos, q, k, cos_sin, w, w)
    want = torch.zeros_like(got)
    write_kv_ref(k_rot, v, want, slots, kv_scale)
    torch.testing.assert_close(q_got, q_want, atol=0, rtol=0)
    _close_fp8(got, want)
    with pytest.raises(ValueError, match="kv_scale"):
        rope_and_cache(pos, q, k, v, cos_sin, got, slots, w, w)


def _fp8_batch(q_lens, ctx, dtype, seed, heads=4, kvh=2, d=32, bs=16):
    b = make_batch(q_lens, ctx, heads, kvh, d, bs, dtype, seed=seed, pad_tokens=2)
    kv_scale = _scales(kvh, seed)
    # K/V of a range the scales map across e4m3's, quantized as the write paths do
    kv = b.kv_cache.float() * 3
    k = quantize_fp8(kv[0].reshape(-1, kvh, d), kv_scale[0]).view(kv[0].shape)
    v = quantize_fp8(kv[1].reshape(-1, kvh, d), kv_scale[1]).view(kv[1].shape)
    b.kv_cache = torch.stack([k, v])
    return b, kv_scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_attention_fp8(dtype: torch.dtype, num_splits: int) -> None:
    """Unified (mixed batch, and decode-only) and split-K paths over an fp8 cache equal the
    float32 reference over fp8 * scale, sliding window included."""
    scale = 32**-0.5
    cases = [([1, 7, 1, 20], [9, 130, 70, 0]), ([1, 1, 1, 0], [150, 1, 40, 0])]
    for q_lens, ctx in cases:
        if num_splits > 1 and max(q_lens) > 1:
            continue
        b, kv_scale = _fp8_batch(q_lens, ctx, dtype, seed=len(ctx) + num_splits)
        for window in (None, 8):
            out = torch.full_like(b.query, 7.0)
            paged_attention(
                b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                b.max_query_len, b.max_seq_len, scale, window, out=out, num_splits=num_splits,
                kv_scale=kv_scale,
            )  # fmt: skip
            ref = paged_attention_ref(
                b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, scale,
                window, kv_scale=kv_scale,
            ).cpu()  # fmt: skip
            n = b.num_actual_tokens
            atol, rtol, _ = TOL[torch.bfloat16]  # K/V in the query's dtype: bf16 at most
            torch.testing.assert_close(out[:n].float().cpu(), ref[:n], atol=atol, rtol=rtol)
            assert (out[n:] == 7.0).all()
    with pytest.raises(ValueError, match="kv_scale"):
        paged_attention(
            b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables,
            b.max_query_len, b.max_seq_len, scale,
        )  # fmt: skip


@pytest.mark.skipif(CUDA, reason="the CPU backend's paths (run on a CPU)")
def test_torch_native_fp8() -> None:
    """The CPU backend writes fp8 K/V and attends over them (decode rows and prefill chunks,
    a first chunk too: it reads its keys back from the cache) as the reference does."""
    heads, kvh, d, bs = 4, 2, 32, 16
    q_lens, ctx = [1, 7, 1, 20], [9, 30, 70, 0]
    b, kv_scale = _fp8_batch(q_lens, ctx, torch.float32, seed=5, heads=heads, kvh=kvh, d=d)
    n = b.num_actual_tokens
    gen = torch.Generator().manual_seed(6)
    key = torch.randn(n, kvh, d, generator=gen)
    value = torch.randn(n, kvh, d, generator=gen)
    # the slots of every new token: its position in its request's blocks
    slots = []
    for r, (ql, c) in enumerate(zip(q_lens, ctx)):
        for p in range(c, c + ql):
            slots.append(int(b.block_tables[r, p // bs]) * bs + p % bs)
    slot_mapping = torch.tensor(slots)
    qsl = b.query_start_loc
    md = AttentionMetadata(
        num_reqs=len(q_lens), num_actual_tokens=n, query_start_loc=qsl, seq_lens=b.seq_lens,
        slot_mapping=slot_mapping, block_tables=b.block_tables, max_query_len=max(q_lens),
        max_seq_len=int(b.seq_lens.max()), block_size=bs, query_start_loc_np=qsl.numpy(),
        seq_lens_np=b.seq_lens.numpy(),
    )  # fmt: skip
    cache = b.kv_cache.clone()
    out = (
        TorchNativeBackend()
        .forward(b.query[:n], key, value, cache, md, d**-0.5, None, kv_scale)
        .view(n, heads, d)
    )
    want_cache = b.kv_cache.clone()
    write_kv_ref(key, value, want_cache, slot_mapping, kv_scale)
    assert torch.equal(cache.view(torch.uint8), want_cache.view(torch.uint8))
    ref = paged_attention_ref(
        b.query[:n], cache, qsl, b.seq_lens, b.block_tables, d**-0.5, kv_scale=kv_scale
    )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
