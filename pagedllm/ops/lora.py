"""Triton kernels of LoRA for a batch that mixes adapters: one launch shrinks, one expands,
for every adapter slot and every sub-projection of a fused layer at once (punica's SGMV).

The step's tokens are grouped by adapter slot on the host (``pagedllm/lora/batch.py``):
``meta`` = [token ids sorted by slot (``max_tokens`` entries) | each slot's start in that
order (L) | each slot's token count (L)]. Example (L 2, slots per token [1, -1, 0, 1]):
sorted ids [2, 0, 3, ...], starts [0, 1], counts [1, 2]; token 1 (slot -1: the base model)
is in no segment and is never touched.

- ``lora_shrink``: s[k, t, :] = x[t] @ A[slot(t), k*R:(k+1)*R, :]^T for every sub-projection
  k (q, k, v of a fused qkv_proj) -> [S, T, R] float32. Grid (M tiles, L, S * SPLIT_K): a
  program takes BLOCK_M tokens of slot l's segment (programs past the segment's end return)
  and one of SPLIT_K stretches of the K dimension, so the grid depends only on T and the
  shapes: a CUDA graph captures it, and the step's ``meta`` and the slots' weights are read
  from static buffers at replay. Split-K (partial sums added atomically into a zeroed ``s``)
  because a decode step has few tokens per slot: without it a slot's whole K loop (48
  iterations for down_proj's 3,072 inputs) ran in one program, a handful of programs in all.
- ``lora_expand``: out[t, off_k + j] += s[k, t, :] @ B[slot(t), off_k + j, :] for j below
  the sub-projection's size; grid (M tiles of the slot-sorted tokens x N tiles, S): a tile
  adds one product per slot among its tokens.

Slots' weights are zero past an adapter's rank (and for a sub-projection it does not
target), so R, the slots' rank, needs no mask. The PyTorch reference is
``pagedllm/lora/ops.py`` (the CPU's path); ``tests/kernels/test_lora_kernels.py`` compares.

This module imports Triton at import time: import it only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K] activations
    a_ptr,  # [L, S * R, K] slots' A
    s_ptr,  # [S, T, R] float32 out
    meta_ptr,  # [max_tokens + 2L] int64 (see the module docstring)
    max_tokens,
    num_slots,
    K,
    stride_xt,
    stride_al,
    stride_ar,
    stride_ss,
    k_per_split,  # a multiple of BLOCK_K
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # > 1: partial sums over K stretches, added atomically
    F32: tl.constexpr,  # dots in float32 (float32 models, and the CPU's interpreter)
):
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    sub = tl.program_id(2) // SPLIT_K
    split = tl.program_id(2) % SPLIT_K
    count = tl.load(meta_ptr + max_tokens + num_slots + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(meta_ptr + max_tokens + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < count
    tok = tl.load(meta_ptr + start + offs_m, mask=mmask, other=0)
    offs_r = tl.arange(0, R)
    a_cols = a_ptr + slot * stride_al + (sub * R + offs_r)[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    # Example: K 3,072, BLOCK_K 64, SPLIT_K 12 -> k_per_split 256: split 5 sums K 1,280-1,535
    k_lo = split * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        x = tl.load(
            x_ptr + tok[:, None] * stride_xt + offs_k[None, :],
            mask=mmask[:, None] & kmask[None, :],
            other=0.0,
        )
        a = tl.load(a_cols + offs_k[:, None], mask=kmask[:, None], other=0.0)  # [BLOCK_K, R]
        if F32:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a.to(x.dtype))
    s_ptrs = s_ptr + sub * stride_ss + tok[:, None] * R + offs_r[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(s_ptrs, acc, mask=mmask[:, None], sem="relaxed")
    else:
        tl.store(s_ptrs, acc, mask=mmask[:, None])


@triton.jit
def _expand_kernel(
    s_ptr,  # [S, T, R] float32 shrink output
    b_ptr,  # [L, N, R] slots' B (scale folded in)
    out_ptr,  # [T, N] the layer's output, added to
    meta_ptr,  # [max_tokens + 2L] int64
    sub_ptr,  # [2S] int64: each sub-projection's output offset, then its size
    max_tokens,
    num_slots,
    num_subs,
    num_n_blocks,
    stride_ot,
    stride_bl,
    stride_bn,
    stride_ss,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F32: tl.constexpr,  # dots in float32 (float32 models, and the CPU's interpreter)
):
    # A program takes BLOCK_M consecutive tokens of the slot-sorted order (not of one slot):
    # the grid no longer grows with the slots (16 slots x 16 M tiles x 48 N tiles x 2 subs
    # were 24,576 programs for gate_up_proj's decode step, most of them returning at once).
    # A tile meets one slot or a few; each slot it meets adds one product, its rows' shrink
    # loaded and the others' zero. Example: BLOCK_M 16, slots' starts [0, 10], counts [10, 20]
    # -> tile 0 (sorted 0-15) takes slot 0's rows 0-9 and slot 1's 10-15; tile 1 slot 1 only.
    pid = tl.program_id(0)
    pid_m = pid // num_n_blocks
    pid_n = pid % num_n_blocks
    sub = tl.program_id(1)
    size = tl.load(sub_ptr + num_subs + sub)
    m0 = pid_m * BLOCK_M
    last = meta_ptr + max_tokens + num_slots - 1  # the last slot's start; its count after
    total = tl.load(last) + tl.load(last + num_slots)  # tokens on an adapter
    if (m0 >= total) | (pid_n * BLOCK_N >= size):
        return
    off = tl.load(sub_ptr + sub)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mmask = offs_m < total
    tok = tl.load(meta_ptr + offs_m, mask=mmask, other=0)
    offs_r = tl.arange(0, R)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < size
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(0, num_slots):
        start = tl.load(meta_ptr + max_tokens + slot)
        end = start + tl.load(meta_ptr + max_tokens + num_slots + slot)
        if (start < m0 + BLOCK_M) & (end > m0):
            rows = mmask & (offs_m >= start) & (offs_m < end)
            sv = tl.load(
                s_ptr + sub * stride_ss + tok[:, None] * R + offs_r[None, :],
                mask=rows[:, None],
                other=0.0,
            )  # [BLOCK_M, R]: this slot's rows, zero elsewhere
            b = tl.load(
                b_ptr + slot * stride_bl + (off + offs_n)[None, :] * stride_bn + offs_r[:, None],
                mask=nmask[None, :],
                other=0.0,
            )  # [R, BLOCK_N]: B's rows as columns
            if F32:
                acc += tl.dot(sv, b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(sv.to(b.dtype), b)
    o_ptrs = out_ptr + tok[:, None] * stride_ot + (off + offs_n)[None, :]
    omask = mmask[:, None] & nmask[None, :]
    o = tl.load(o_ptrs, mask=omask, other=0.0)
    tl.store(o_ptrs, (o.to(tl.float32) + acc).to(o.dtype), mask=omask)


def _f32(t: torch.Tensor) -> bool:
    """Dots in float32: for float32 models, and under the CPU's interpreter (whose bfloat16
    dots are wrong; the attention kernels upcast there too)."""
    return t.dtype == torch.float32 or t.device.type == "cpu"


def _block_m(num_tokens: int) -> int:
    # decode batches spread few tokens over each slot: narrow tiles (a tile past a slot's
    # tokens returns at once); prompts take wider tiles
    return 16 if num_tokens <= 512 else 64


SHRINK_BLOCK_K = 64
SHRINK_K_PER_SPLIT = 256  # K elements a split-K program sums (4 loop steps of BLOCK_K)


def shrink_split_k(num_tokens: int, k: int) -> int:
    """How many K stretches the shrink splits into: up to 2,048 tokens (decode and small
    mixed steps, few tiles per slot) one per 256 inputs, else 1 (prompts fill the GPU with
    M tiles). Example: K 1,024 -> 4; down_proj's 3,072 -> 12."""
    return triton.cdiv(k, SHRINK_K_PER_SPLIT) if num_tokens <= 2048 else 1


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    meta: torch.Tensor,
    max_tokens: int,
    rank: int,
    block_m: int | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """[T, K] x, [L, S * R, K] slots' A (R = ``rank``, a power of two >= 16), the step's
    ``meta`` -> [S, T, R] float32 (rows of tokens without an adapter: zero with split-K,
    else unwritten). ``block_m``/``split_k`` override the defaults (``_block_m``,
    ``shrink_split_k``; the micro-benchmark sweeps them)."""
    T, K = x.shape
    L, SR, _ = a.shape
    R = rank
    S = SR // R
    assert x.stride(1) == 1 and a.stride(2) == 1
    bm = block_m or _block_m(T)
    split = split_k or shrink_split_k(T, K)
    bk = SHRINK_BLOCK_K
    per = triton.cdiv(triton.cdiv(K, split), bk) * bk  # K elements per split, whole blocks
    split = triton.cdiv(K, per)  # (no empty split: K 100, split 4 -> per 64 -> 2 splits)
    alloc = torch.zeros if split > 1 else torch.empty
    s = alloc((S, T, R), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(T, bm), L, S * split)
    _shrink_kernel[grid](
        x, a, s, meta, max_tokens, L, K, x.stride(0), a.stride(0), a.stride(1), s.stride(0),
        per, R=R, BLOCK_M=bm, BLOCK_K=bk, SPLIT_K=split, F32=_f32(x),
    )  # fmt: skip
    return s


def lora_expand(
    s: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    meta: torch.Tensor,
    subs: torch.Tensor,
    max_tokens: int,
    max_sub_size: int,
    block_m: int | None = None,
) -> None:
    """``out`` [T, N] += each token's [S, R] shrink times its slot's B [L, N, R], each
    sub-projection into its own columns (``subs``: [2S] offsets then sizes, on the device;
    ``max_sub_size``: the largest size, on the host)."""
    S, T, R = s.shape
    L = b.shape[0]
    assert out.stride(1) == 1 and b.stride(2) == 1
    bm, bn = block_m or _block_m(T), 64
    nb = triton.cdiv(max_sub_size, bn)
    grid = (triton.cdiv(T, bm) * nb, S)
    _expand_kernel[grid](
        s, b, out, meta, subs, max_tokens, L, S, nb, out.stride(0), b.stride(0), b.stride(1),
        s.stride(0), R=R, BLOCK_M=bm, BLOCK_N=bn, F32=_f32(out),
    )  # fmt: skip
