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


def test_rope_and_cache_fp8_per_head() -> None:
    """KV-Compress's per-head cache: the fused rotary kernel writes each (token, KV head)'s
    rotated K and its V at that head's own slot, quantized with that head's scales, as
    rope + ``write_head_kv`` do."""
    from pagedllm.kvcompress.attention import write_head_kv

    t, h, kvh, d, bs, nb = 6, 4, 2, 32, 4, 10
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(t, h, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    k = (torch.randn(t, kvh, d, generator=gen) * 4).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(t, kvh, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    pos = torch.tensor([0, 3, 9, 10, 30, 31], device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(64).float(), inv)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)
    slots = torch.tensor([[1, 20], [5, 33], [-1, -1], [8, 2], [12, 39], [16, 30]],
                         device=DEVICE)  # [T, H]: a slot per head (-1: no write)  # fmt: skip
    kv_scale = torch.tensor([[0.02, 0.5], [0.01, 0.3]], device=DEVICE)
    got = torch.zeros(2, nb, bs, d, dtype=FP8, device=DEVICE)
    rope_and_cache(pos, q, k, v, cos_sin, got, slots, kv_scale=kv_scale)
    _, k_rot = rope(pos, q, k, cos_sin)
    want = torch.zeros_like(got)
    ok = (slots >= 0).all(1)
    write_head_kv(k_rot[ok], v[ok], want[0].view(-1, d), want[1].view(-1, d), slots[ok],
                  kv_scale)  # fmt: skip
    _close_fp8(got, want)


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


def test_kv_compress_torch_path_reads_each_heads_scale() -> None:
    """KV-Compress's per-head cache in fp8 (the CPU path, ``kvcompress/attention.py``):
    ``write_head_kv`` quantizes each head's K and V with that head's scales, and decode,
    prefill and the prompt's window scores read fp8 x scale, so outputs and scores equal
    those over a float32 cache holding the same dequantized values. The two heads' scales
    differ 40-fold: a head read with the other's would not match."""
    from pagedllm.kvcompress.attention import (
        decode_attention,
        prefill_attention,
        prefill_window_scores_batched,
        write_head_kv,
    )
    from pagedllm.kvcompress.evict import head_slots

    torch.manual_seed(0)
    h, g, d, bs, num_blocks, n = 2, 2, 16, 4, 12, 10
    kv_scale = torch.tensor([[0.05, 2.0], [0.03, 1.5]])  # [2, H]
    key = torch.randn(n, h, d) * torch.tensor([3.0, 100.0])[None, :, None]
    value = torch.randn(n, h, d) * torch.tensor([2.0, 80.0])[None, :, None]
    tables = torch.tensor([[[0, 3, 5], [1, 2, 4]]], dtype=torch.int32)  # [1, H, 3]
    lens = torch.tensor([[n, n]])
    slots, _ = head_slots(tables, lens, n, bs)  # [1, H, n]
    slots = slots[0].T.contiguous()  # [n, H]: token t's slot in each head
    fp8 = torch.zeros(2, num_blocks, bs, d, dtype=FP8)
    f32 = torch.zeros(2, num_blocks, bs, d)
    write_head_kv(key, value, fp8[0].view(-1, d), fp8[1].view(-1, d), slots, kv_scale)
    deq_k = dequantize(quantize_fp8(key, kv_scale[0]), kv_scale[0], torch.float32)
    deq_v = dequantize(quantize_fp8(value, kv_scale[1]), kv_scale[1], torch.float32)
    write_head_kv(deq_k, deq_v, f32[0].view(-1, d), f32[1].view(-1, d), slots)
    caches = {"fp8": (fp8, kv_scale), "f32": (f32, None)}
    q_dec = torch.randn(1, h * g, d)
    q_pre = torch.randn(4, h * g, d)  # the last 4 tokens as a prefill chunk
    got = {}
    for name, (cache, sc) in caches.items():
        k_flat, v_flat = cache[0].view(-1, d), cache[1].view(-1, d)
        s_dec = torch.zeros(num_blocks * bs)
        s_pre = torch.zeros(num_blocks * bs)
        s_win = torch.zeros(num_blocks * bs)
        o_dec = decode_attention(q_dec, k_flat, v_flat, tables, lens, bs, 0.2, scores=s_dec,
                                 kv_scale=sc)  # fmt: skip
        o_pre = prefill_attention(q_pre, k_flat, v_flat, tables[0], lens[0], bs, 0.2,
                                  scores=s_pre, collect=3, kv_scale=sc)  # fmt: skip
        prefill_window_scores_batched(
            q_pre, k_flat, tables, lens, torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=bool),
            bs, 0.2, s_win, 0, n, k_scale=None if sc is None else sc[0],
        )  # fmt: skip
        got[name] = (o_dec, o_pre, s_dec, s_pre, s_win)
    for a, b in zip(got["fp8"], got["f32"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert got["f32"][2].abs().sum() > 0 and got["f32"][4].abs().sum() > 0
