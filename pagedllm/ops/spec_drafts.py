"""Triton kernels for drafts made on the device (ngram_gpu; ``worker/device_drafts.py``): one
launch before a step's forward pass and one after its sampling, in place of some fifty small
PyTorch ops whose host time (milliseconds a step) would bound an asynchronous step at batch 1.

- ``prepare``: one program per request row of the step. A row whose last step is unresolved
  takes the rejected drafts ``d = unverified - accepted[row]`` off its positions, its sequence
  length and its slots (every KV-cache group's, from the tables by position); a row verifying
  ``ks`` drafts gets its device drafts written into the input ids after its first token; every
  row's drafts and their valid mask are kept (what the step verifies: the lookup after it
  overwrites them).
- ``verify``: one program per sampling row. The drafts accepted ``a`` (the first draft unequal
  to the sample before it, or ``ks``), the bonus sample ``a``, the samples into the history,
  the new length and, unless paused, the n-gram lookup over the new history: the largest
  ``n <= MAX_N`` whose last n tokens occur earlier, its most recent occurrence, the K tokens
  after it, repeating with the match's period where they reach the end
  (``spec_decode/ngram_gpu.py``'s rule, scanned in blocks of the history).

The PyTorch versions in ``DeviceDrafts`` are the reference (and the CPU's path). No host sync,
no data-dependent Python branch.

This module imports Triton at import time: import it only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _prepare_kernel(
    ids_ptr,  # [T] int32 input ids (drafts written)
    pos_ptr,  # [T] int32 positions (corrected)
    seq_ptr,  # [R] int32 sequence lengths (corrected)
    qsl_ptr,  # [R + 1] int32 query start locations
    slot_ptr,  # [G, T] int64 slots (corrected)
    bt_ptr,  # [G, R, max_blocks] int32 block tables of the step's rows
    meta_ptr,  # [3R] int64: InputBatch rows, unverified drafts, drafts to verify
    accepted_ptr,  # [rows] int64 drafts accepted by each row's last verification
    drafts_ptr,  # [rows, K] int32 each row's newest lookup
    nvalid_ptr,  # [rows] int64 its valid drafts
    used_ptr,  # [R, K] int32 out: the drafts each row verifies
    valid_ptr,  # [R, K] int8 out: which of them are valid
    num_reqs,
    num_groups,
    stride_sg,
    stride_st,
    stride_bg,
    stride_br,
    stride_bb,
    block_size,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= K + 1
):
    i = tl.program_id(0)
    row = tl.load(meta_ptr + i)
    unv = tl.load(meta_ptr + num_reqs + i)
    kk = tl.load(meta_ptr + 2 * num_reqs + i)
    acc = tl.load(accepted_ptr + row)
    d = tl.where(unv > 0, unv - acc, 0)  # e.g. 4 unverified, 1 accepted -> 3
    start = tl.load(qsl_ptr + i).to(tl.int64)
    n = tl.load(qsl_ptr + i + 1).to(tl.int64) - start
    offs = tl.arange(0, BLOCK_K)
    tmask = (offs < n) & (d > 0)  # (a row with d > 0 is a decode row: 1 + k tokens at most)
    p = tl.load(pos_ptr + start + offs, mask=tmask, other=0).to(tl.int64) - d
    tl.store(pos_ptr + start + offs, p.to(tl.int32), mask=tmask)
    for g in range(num_groups):
        # Example: block_size 16, table [7, 3], position 20 -> 3 * 16 + 4 = 52
        at = bt_ptr + g * stride_bg + i * stride_br + (p // block_size) * stride_bb
        blk = tl.load(at, mask=tmask)
        slot = blk.to(tl.int64) * block_size + p % block_size
        tl.store(slot_ptr + g * stride_sg + (start + offs) * stride_st, slot, mask=tmask)
    seq = tl.load(seq_ptr + i)
    tl.store(seq_ptr + i, (seq - d).to(tl.int32))
    kmask = offs < K
    dmask = offs < kk
    dr = tl.load(drafts_ptr + row * K + offs, mask=kmask & dmask, other=0)
    tl.store(ids_ptr + start + 1 + offs, dr, mask=kmask & dmask)
    nv = tl.load(nvalid_ptr + row)
    tl.store(used_ptr + i * K + offs, dr, mask=kmask)
    tl.store(valid_ptr + i * K + offs, (dmask & (offs < nv)).to(tl.int8), mask=kmask)


@triton.jit
def _verify_kernel(
    samples_ptr,  # [P] int64 the step's samples
    meta_ptr,  # [4S] int64: InputBatch rows, first sample, drafts, batch index
    seq_ptr,  # [R] int32 the step's sequence lengths (corrected)
    used_ptr,  # [R, K] int32 the drafts each row verified
    valid_ptr,  # [R, K] int8
    hist_ptr,  # [rows, width] int32 token histories
    lens_ptr,  # [rows] int64
    acc_ptr,  # [rows] int64
    drafts_ptr,  # [rows, K] int32
    nvalid_ptr,  # [rows] int64
    bonus_ptr,  # [S] int64 out: each row's newest token
    num_samples,
    hist_stride,
    scan_width,  # a bound on every row's length after the step
    min_n,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= K + 1
    MAX_N: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next power of two >= MAX_N
    BLOCK_W: tl.constexpr,
    LOOKUP: tl.constexpr,
):
    s = tl.program_id(0)
    row = tl.load(meta_ptr + s)
    first = tl.load(meta_ptr + num_samples + s)
    ks = tl.load(meta_ptr + 2 * num_samples + s)
    bi = tl.load(meta_ptr + 3 * num_samples + s)
    seq = tl.load(seq_ptr + bi).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    smask = offs <= ks
    tok = tl.load(samples_ptr + first + offs, mask=smask, other=-1)
    u = tl.load(used_ptr + bi * K + offs, mask=offs < K, other=0)
    v = tl.load(valid_ptr + bi * K + offs, mask=offs < K, other=0)
    eq = (tok == u) & (v != 0) & (offs < ks)
    # a = the first draft not equal to its sample (or ks): e.g. eq [1, 1, 0, 1] -> 2
    a = tl.minimum(tl.min(tl.where(eq, BLOCK_K, offs), axis=0), ks)
    bonus = tl.sum(tl.where(offs == a, tok, 0), axis=0)
    tl.store(bonus_ptr + s, bonus)
    hrow = hist_ptr + row * hist_stride
    # sample j at position seq - ks + j (the row's first sample at seq - ks)
    tl.store(hrow + seq - ks + offs, tok.to(tl.int32), mask=smask)
    length = seq - ks + a + 1
    tl.store(lens_ptr + row, length)
    tl.store(acc_ptr + row, a)
    if LOOKUP:
        tl.debug_barrier()  # the samples just stored are read back below
        last = length - 1
        cap = tl.minimum(last, MAX_N)
        jo = tl.arange(0, BLOCK_N)
        suffix = tl.load(hrow + last - jo, mask=jo < cap, other=-1)  # read backwards
        best_len = tl.full([], 0, tl.int32)
        best_e = tl.full([], -1, tl.int64)
        for w0 in range(0, scan_width, BLOCK_W):
            e = w0 + tl.arange(0, BLOCK_W).to(tl.int64)
            running = e < last  # an earlier occurrence ends before the last token
            mlen = tl.zeros([BLOCK_W], dtype=tl.int32)
            for j in tl.static_range(MAX_N):
                s_j = tl.sum(tl.where(jo == j, suffix, 0), axis=0)
                t = tl.load(hrow + e - j, mask=running & (e >= j), other=-1)
                running = running & (t == s_j) & (j < cap)
                mlen += running.to(tl.int32)
            bmax = tl.max(mlen, axis=0)
            be = tl.max(tl.where(mlen == bmax, e, -1), axis=0)
            # blocks come in order: an equal length later is a more recent occurrence
            upd = (bmax > 0) & (bmax >= best_len)
            best_e = tl.where(upd, be, best_e)
            best_len = tl.where(upd, bmax, best_len)
        ok = best_len >= min_n
        # draft j at best_e + 1 + j % period (the match's period: repeating past the end)
        period = tl.maximum(last - best_e, 1)
        idx = best_e + 1 + offs % period
        dv = ok & (offs < K)
        dr = tl.load(hrow + idx, mask=dv, other=0)
        tl.store(drafts_ptr + row * K + offs, dr, mask=offs < K)
        tl.store(nvalid_ptr + row, tl.sum(dv.to(tl.int64), axis=0))


def prepare(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    meta: torch.Tensor,
    accepted: torch.Tensor,
    drafts: torch.Tensor,
    num_valid: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``prepare`` launch (see the module docstring); returns ``(used [R, K] int32,
    valid [R, K] int8)``. ``slots`` [G, T], ``tables`` [G, R, max_blocks]; ``meta`` [3R]."""
    num_reqs = seq_lens.shape[0]
    k = drafts.shape[1]
    used = torch.empty(num_reqs, k, dtype=torch.int32, device=drafts.device)
    valid = torch.empty(num_reqs, k, dtype=torch.int8, device=drafts.device)
    _prepare_kernel[(num_reqs,)](
        input_ids, positions, seq_lens, query_start_loc, slots, tables, meta, accepted,
        drafts, num_valid, used, valid, num_reqs, slots.shape[0], slots.stride(0),
        slots.stride(1), tables.stride(0), tables.stride(1), tables.stride(2), block_size,
        K=k, BLOCK_K=triton.next_power_of_2(k + 1),
    )  # fmt: skip
    return used, valid


def verify(
    samples: torch.Tensor,
    meta: torch.Tensor,
    seq_lens: torch.Tensor,
    used: torch.Tensor,
    valid: torch.Tensor,
    hist: torch.Tensor,
    lens: torch.Tensor,
    accepted: torch.Tensor,
    drafts: torch.Tensor,
    num_valid: torch.Tensor,
    scan_width: int,
    min_n: int,
    max_n: int,
    lookup: bool,
) -> torch.Tensor:
    """The ``verify`` launch (see the module docstring); returns the bonus tokens [S] int64.
    ``meta`` [4S]."""
    num = meta.shape[0] // 4
    k = drafts.shape[1]
    bonus = torch.empty(num, dtype=torch.int64, device=samples.device)
    _verify_kernel[(num,)](
        samples, meta, seq_lens, used, valid, hist, lens, accepted, drafts, num_valid, bonus,
        num, hist.stride(0), scan_width, min_n,
        K=k, BLOCK_K=triton.next_power_of_2(k + 1), MAX_N=max_n,
        BLOCK_N=triton.next_power_of_2(max_n), BLOCK_W=256, LOOKUP=lookup,
    )  # fmt: skip
    return bonus
