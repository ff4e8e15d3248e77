"""Triton rotary embedding for q and k in one kernel, optionally after a per-head RMSNorm
(Qwen3's and Gemma 3's q/k norms), where PyTorch runs ~20 kernels (index the cos/sin table,
cast, split, four products, two sums, concatenate, cast back; for q and again for k; plus the
norms' seven each).

Neox layout, as ``pagedllm.model.layers.rotary`` (the reference): each head's two halves
x1 = x[:half], x2 = x[half:] become (x1 cos - x2 sin, x2 cos + x1 sin), in float32, rounded to
the input dtype once. ``cos_sin`` is [max_position, head_dim] float32, cos in the first half.
The norm keeps the RMSNorm layer's roundings (its output is rounded to the dtype before the
rotation reads it, as when the two run apart).

Inputs: q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim], any
strides with a contiguous last dim (views into the fused qkv projection). Outputs: new
contiguous tensors of the same shapes. Grid: (num_tokens,): program t loads token t's cos/sin
row once and rotates all its query heads as one [heads, head_dim / 2] tile, then all its key
heads (a program per (token, head) would launch thousands of one-warp programs a layer, more
than the SMs hold in one wave). No host sync, so it is
CUDA-graph capturable.

``rope_and_cache`` writes the rotated K, and V, straight into the paged KV cache at each
token's slot (as :mod:`pagedllm.ops.kv_write`: slot -1 and tokens past the slot list are
skipped) instead of returning K, so the attention layer runs one kernel where it ran two.

This module imports Triton at import time: import it only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kv_layout import is_fp8


@triton.jit
def _rope_heads(
    src_ptr,  # this token's first head of q (or k)
    dst_ptr,  # this token's first output head (or its K row in the paged cache)
    stride_h,
    dst_stride_h,
    n_heads,
    store,  # False: compute, write nothing (a CUDA-graph padding row's K)
    w_ptr,  # [2 * HALF] norm weight (unused without HAS_NORM)
    cos,  # [1, HALF_PAD] float32
    sin,
    eps,
    offset,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= n_heads
    HAS_NORM: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    scale_ptr=None,  # QUANT: [n_heads] float32 (an fp8 cache's K scales)
    QUANT: tl.constexpr = False,  # store fp8(clamp(x / scale, -448, 448))
):
    """Norm and rotate the ``n_heads`` heads of one token as one [HEADS_PAD, HALF_PAD] tile."""
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < n_heads) & (d < HALF)
    src = src_ptr + h * stride_h + d
    a = tl.load(src, mask=mask, other=0.0)  # x1 of every head
    b = tl.load(src + HALF, mask=mask, other=0.0)  # x2
    x1 = a.to(tl.float32)
    x2 = b.to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [HEADS_PAD]
        rstd = tl.rsqrt(ss / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        if HAS_OFFSET:  # Gemma: x / rms * (1 + w), one rounding
            x1 = (x1 * rstd * (offset + w1)).to(a.dtype).to(tl.float32)
            x2 = (x2 * rstd * (offset + w2)).to(a.dtype).to(tl.float32)
        else:  # Llama / Qwen: round(x / rms), then times w, rounded
            x1 = ((x1 * rstd).to(a.dtype).to(tl.float32) * w1).to(a.dtype).to(tl.float32)
            x2 = ((x2 * rstd).to(a.dtype).to(tl.float32) * w2).to(a.dtype).to(tl.float32)
    dst = dst_ptr + h * dst_stride_h + d
    out_ty = dst_ptr.dtype.element_ty
    y1 = (x1 * cos - x2 * sin).to(a.dtype)
    y2 = (x2 * cos + x1 * sin).to(a.dtype)
    if QUANT:  # rounded to the model's dtype first, as write_kv_ref quantizes
        s = tl.load(scale_ptr + h, mask=h < n_heads, other=1.0)  # [HEADS_PAD, 1]
        y1 = tl.clamp(y1.to(tl.float32) / s, -448.0, 448.0)
        y2 = tl.clamp(y2.to(tl.float32) / s, -448.0, 448.0)
    tl.store(dst, y1.to(out_ty), mask=mask & store)
    tl.store(dst + HALF, y2.to(out_ty), mask=mask & store)


# the step's token count (num_slots) and its positions / slots (views of step buffers) vary:
# no specialization on them (Triton compiles a variant for 1, for multiples of 16 and for the
# rest, and per alignment; each compile stalls the step that first meets it)
@triton.jit(
    do_not_specialize=["num_slots"],
    do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"],
)
def _rope_kernel(
    pos_ptr,  # [num_tokens] int64
    q_ptr,
    k_ptr,
    qo_ptr,  # [num_tokens, num_heads, 2 * HALF] contiguous
    ko_ptr,  # [num_tokens, num_kv_heads, 2 * HALF] contiguous
    cs_ptr,  # [max_position, 2 * HALF] float32: cos | sin
    qw_ptr,  # [2 * HALF] q-norm weight (unused without HAS_NORM)
    kw_ptr,  # [2 * HALF] k-norm weight
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    num_heads,
    num_kv_heads,
    eps,
    offset,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,  # next power of two >= HALF
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    WRITE_KV: tl.constexpr,  # rotated K and V go to the paged cache at the token's slot
    v_ptr=None,  # WRITE_KV only: [num_tokens, num_kv_heads, 2 * HALF] any strides
    v_cache_ptr=None,  # ko_ptr is then the K cache: [num_blocks, block_size, kv_heads, D]
    slot_ptr=None,  # [num_slots] int64, -1 = skip
    num_slots=0,
    stride_vt=0,
    stride_vh=0,
    stride_cb=0,
    stride_cs=0,
    stride_ch=0,
    BLOCK_SIZE: tl.constexpr = 16,
    PER_HEAD: tl.constexpr = False,  # slot_ptr is [num_slots, num_kv_heads]: a slot per head
    stride_st=0,  # PER_HEAD: the slot list's token stride
    scale_ptr=None,  # QUANT: [2, num_kv_heads] float32 (an fp8 cache's K, then V scales)
    QUANT: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cs_ptr + pos * (2 * HALF) + d, mask=d < HALF, other=0.0)  # [1, HALF_PAD]
    sin = tl.load(cs_ptr + pos * (2 * HALF) + HALF + d, mask=d < HALF, other=0.0)
    _rope_heads(
        q_ptr + t * stride_qt, qo_ptr + t * num_heads * (2 * HALF), stride_qh, 2 * HALF,
        num_heads, True, qw_ptr, cos, sin, eps, offset, HALF, HALF_PAD, Q_HEADS_PAD, HAS_NORM,
        HAS_OFFSET,
    )  # fmt: skip
    if WRITE_KV and PER_HEAD:
        # KV-Compress's cache: every (token, KV head) has its own slot in one-head blocks.
        # Example: BLOCK_SIZE 16, head_dim 64, slots [37, 5] -> K rows at element offsets
        # (2 * 16 + 5) * 64 and 5 * 64 of the K cache.
        hh = tl.arange(0, K_HEADS_PAD)
        slots = tl.load(slot_ptr + t * stride_st + hh, mask=(hh < num_kv_heads) & (t < num_slots),
                        other=-1).to(tl.int64)  # fmt: skip
        rows = ((slots // BLOCK_SIZE) * stride_cb + (slots % BLOCK_SIZE) * stride_cs)[:, None]
        ok = (slots >= 0)[:, None]
        _rope_heads(
            k_ptr + t * stride_kt, ko_ptr + rows, stride_kh, 0, num_kv_heads, ok,
            kw_ptr, cos, sin, eps, offset, HALF, HALF_PAD, K_HEADS_PAD, HAS_NORM, HAS_OFFSET,
            scale_ptr, QUANT,
        )  # fmt: skip
        h = hh[:, None]
        vmask = (h < num_kv_heads) & (d < HALF) & ok
        src = v_ptr + t * stride_vt + h * stride_vh + d
        dst = v_cache_ptr + rows + d
        out_ty = v_cache_ptr.dtype.element_ty
        v1 = tl.load(src, mask=vmask)
        v2 = tl.load(src + HALF, mask=vmask)
        if QUANT:  # each head's own V scale
            vs = tl.load(scale_ptr + num_kv_heads + h, mask=h < num_kv_heads, other=1.0)
            v1 = tl.clamp(v1.to(tl.float32) / vs, -448.0, 448.0)
            v2 = tl.clamp(v2.to(tl.float32) / vs, -448.0, 448.0)
        tl.store(dst, v1.to(out_ty), mask=vmask)
        tl.store(dst + HALF, v2.to(out_ty), mask=vmask)
    elif WRITE_KV:
        slot = tl.load(slot_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
        # Example: BLOCK_SIZE 16, slot 37 -> block 2, offset 5. Slot -1 gives a negative row
        # that no store reaches: every store below is masked by slot >= 0.
        row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        _rope_heads(
            k_ptr + t * stride_kt, ko_ptr + row, stride_kh, stride_ch, num_kv_heads, slot >= 0,
            kw_ptr, cos, sin, eps, offset, HALF, HALF_PAD, K_HEADS_PAD, HAS_NORM, HAS_OFFSET,
            scale_ptr, QUANT,
        )  # fmt: skip
        h = tl.arange(0, K_HEADS_PAD)[:, None]
        vmask = (h < num_kv_heads) & (d < HALF) & (slot >= 0)
        src = v_ptr + t * stride_vt + h * stride_vh + d
        dst = v_cache_ptr + row + h * stride_ch + d
        out_ty = v_cache_ptr.dtype.element_ty
        v1 = tl.load(src, mask=vmask)
        v2 = tl.load(src + HALF, mask=vmask)
        if QUANT:
            vs = tl.load(scale_ptr + num_kv_heads + h, mask=h < num_kv_heads, other=1.0)
            v1 = tl.clamp(v1.to(tl.float32) / vs, -448.0, 448.0)
            v2 = tl.clamp(v2.to(tl.float32) / vs, -448.0, 448.0)
        tl.store(dst, v1.to(out_ty), mask=vmask)
        tl.store(dst + HALF, v2.to(out_ty), mask=vmask)
    else:
        _rope_heads(
            k_ptr + t * stride_kt, ko_ptr + t * num_kv_heads * (2 * HALF), stride_kh, 2 * HALF,
            num_kv_heads, True, kw_ptr, cos, sin, eps, offset, HALF, HALF_PAD, K_HEADS_PAD,
            HAS_NORM, HAS_OFFSET,
        )  # fmt: skip


def _check(
    q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
) -> None:  # fmt: skip
    if q.dim() != 3 or k.dim() != 3 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("rope needs 3-D q and k with a contiguous last dim")
    tokens, _, head_dim = q.shape
    if k.shape[0] != tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} do not match")
    if cos_sin.shape[1] != head_dim or cos_sin.dtype != torch.float32:
        raise ValueError("rope: cos_sin must be float32 [max_position, head_dim]")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("rope: give both q and k norm weights or neither")


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,  # [tokens, kv_heads, D], or the K cache with ``kv`` given
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    offset: float,
    kv: dict | None = None,  # the cache-write arguments of _rope_kernel
) -> None:
    tokens, heads, head_dim = q.shape
    has_norm = q_weight is not None
    half = head_dim // 2
    half_pad = triton.next_power_of_2(half)
    q_pad, k_pad = triton.next_power_of_2(heads), triton.next_power_of_2(k.shape[1])
    _rope_kernel[(tokens,)](
        positions, q, k, q_out, k_out, cos_sin,
        q_weight if has_norm else cos_sin, k_weight if has_norm else cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), heads, k.shape[1], eps, offset,
        HALF=half, HALF_PAD=half_pad, Q_HEADS_PAD=q_pad, K_HEADS_PAD=k_pad,
        HAS_NORM=has_norm, HAS_OFFSET=bool(offset), WRITE_KV=kv is not None,
        num_warps=8 if q_pad * half_pad >= 4096 else 4, **(kv or {}),
    )  # fmt: skip


def rope(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: torch.Tensor,  # [max_position, head_dim] float32
    q_weight: torch.Tensor | None = None,  # [head_dim]: RMSNorm each q head first
    k_weight: torch.Tensor | None = None,  # [head_dim]: RMSNorm each k head first
    eps: float = 1e-6,
    offset: float = 0.0,  # Gemma's (offset + w) norm scaling
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotate(norm(q)), rotate(norm(k))) by ``positions``; without weights no norm."""
    _check(q, k, cos_sin, q_weight, k_weight)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0]:
        _launch(positions, q, k, q_out, k_out, cos_sin, q_weight, k_weight, eps, offset)
    return q_out, k_out


def rope_and_cache(
    positions: torch.Tensor,  # [num_tokens] int64
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin: torch.Tensor,  # [max_position, head_dim] float32
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [n] int64, n <= num_tokens; -1 = skip
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    kv_scale: torch.Tensor | None = None,  # [2, num_kv_heads] float32: an fp8 cache's scales
) -> torch.Tensor:
    """:func:`rope`, with the rotated K and V written straight into the paged cache at
    ``slot_mapping`` (as :func:`pagedllm.ops.kv_write.write_kv_cache` would, slot -1 and tokens
    past ``len(slot_mapping)`` skipped) instead of returned: one kernel where there were two,
    and K is never written out only to be read back. Returns rotate(norm(q)).

    KV-Compress's per-head cache (``kv_cache`` [2, num_blocks, block_size, head_dim], one KV
    head per block) takes ``slot_mapping`` [n, num_kv_heads] (any token stride): each head of
    each token goes to its own slot. An fp8 cache (``torch.float8_e4m3fn``, not per head)
    stores fp8(clamp(x / scale, -448, 448)) with ``kv_scale``."""
    _check(q, k, cos_sin, q_weight, k_weight)
    if v.shape != k.shape or v.stride(-1) != 1:
        raise ValueError(f"rope_and_cache: v {tuple(v.shape)} must match k {tuple(k.shape)}")
    per_head = kv_cache.dim() == 4
    if per_head:
        ok = kv_cache.shape[0] == 2 and kv_cache.shape[3] == k.shape[2]
        ok = ok and slot_mapping.dim() == 2 and slot_mapping.shape[1] == k.shape[1]
        ok = ok and slot_mapping.stride(1) == 1
    else:
        ok = kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[3:] == k.shape[1:]
    if not ok:
        raise ValueError(f"rope_and_cache: kv_cache {tuple(kv_cache.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} do not fit k {tuple(k.shape)}")  # fmt: skip
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("rope_and_cache: the cache needs a contiguous last dim")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0]:
        kv = {
            "v_ptr": v, "v_cache_ptr": v_cache, "slot_ptr": slot_mapping,
            "num_slots": slot_mapping.shape[0], "stride_vt": v.stride(0),
            "stride_vh": v.stride(1), "stride_cb": k_cache.stride(0),
            "stride_cs": k_cache.stride(1), "stride_ch": 0 if per_head else k_cache.stride(2),
            "BLOCK_SIZE": kv_cache.shape[2], "PER_HEAD": per_head,
            "stride_st": slot_mapping.stride(0) if per_head else 0,
        }  # fmt: skip
        if is_fp8(kv_cache.dtype):
            if kv_scale is None:
                raise ValueError("rope_and_cache: an fp8 cache needs kv_scale")
            kv.update(scale_ptr=kv_scale, QUANT=True)
        _launch(positions, q, k, q_out, k_cache, cos_sin, q_weight, k_weight, eps, offset, kv)
    return q_out
