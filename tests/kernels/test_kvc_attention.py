"""Triton kernels over KV-Compress's per-head paged cache (pagedllm/ops/kvc_attention/)
against plain PyTorch references.

Every (row, KV head) gets its own random length (0, 1, a multiple of the block size and
lengths that are not) and its own blocks (distinct ids, scattered over the cache). Slots that
no query may see hold NaN (past a head's length, blocks in no table, and for the decode kernel
the keys before the window), so a kernel that reads one shows it. Decode: single pass and
split-K, with and without the in-place scores update (checked slot by slot: attended slots
gain the reference's sum over the GQA group of p^2, every other slot is unchanged). Mixed
batches: prefill chunks and decodes through the unified paged kernel. The KV-Compress Triton
backend (which calls both) against the torch backend on whole steps.

On a machine without CUDA the kernels run through Triton's interpreter (see triton_setup.py)
on small shapes (block sizes 4/8, 16-key tiles, head_dim 64); on CUDA the block sizes are
16/32, the contexts longer, head_dim 128/256 are added and the default tile shapes are used.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from tests.kernels.triton_setup import CUDA, DEVICE, cuda_only

# isort: split

import numpy as np

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kvcompress.attention import (
    KVCLayerInfo,
    KVCStepPlan,
    KVCTorchBackend,
    VerifyQueries,
)
from pagedllm.kvcompress.triton_backend import KVCTritonBackend
from pagedllm.ops.kvc_attention import (
    kvc_decode_attention,
    kvc_decode_num_splits,
    kvc_paged_attention,
)
from pagedllm.ops.paged_attention import TileConfig

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# max |out - ref| <= atol + rtol * |ref| (as in test_paged_attention.py)
TOL = {
    torch.bfloat16: (1.5e-2, 1.5e-2),
    torch.float16: (3e-3, 3e-3),
    torch.float32: (1e-4, 1e-4),
}
# Scores: p comes from the same (exact) products in every dtype: only fp32 rounding differs.
SCORE_TOL = (2e-5, 1e-3)
# (num_heads, num_kv_heads): GQA ratios 1, 2, 4
GQA = [(4, 4), (4, 2), (8, 2)]
GQA_CUDA = [(4, 4), (8, 2), (8, 1)]  # 1, 4, 8 (Llama-3-8B's ratio is 4, Qwen3-0.6B's 2)
# The interpreter gets small blocks and tiles, so that tiles span several blocks and some
# tiles are mask-free; CUDA runs the default tile shapes.
BLOCK_SIZES = (16, 32) if CUDA else (4, 8)
TILE = None if CUDA else TileConfig(block_m=16, tile_n=16)


def _params() -> list:
    """(dtype, num_heads, num_kv_heads, head_dim, block_size): head_dim 64 with every GQA ratio
    in every dtype (fp16 only with GQA 4 in the interpreter, which computes 16-bit inputs in
    fp32 anyway); on CUDA only, bf16 and fp16 x head_dim 64/128/256 x GQA 1/4/8 x block sizes
    16/32 (the issue's matrix)."""
    params = []
    for dtype in DTYPES:
        for i, (hq, h) in enumerate(GQA):
            if dtype == torch.float16 and not CUDA and hq // h != 4:
                continue
            bs = BLOCK_SIZES[i % 2]
            params.append(pytest.param(dtype, hq, h, 64, bs, id=f"{dtype}-q{hq}-kv{h}-d64-bs{bs}"))
    for dtype in (torch.bfloat16, torch.float16):
        for hd, (hq, h), bs in itertools.product((64, 128, 256), GQA_CUDA, BLOCK_SIZES):
            name = f"big-{dtype}-q{hq}-kv{h}-d{hd}-bs{bs}"
            params.append(pytest.param(dtype, hq, h, hd, bs, id=name, marks=cuda_only))
    return params


PARAMS = _params()


@dataclass
class HeadCache:
    """A per-head paged cache on the CPU (moved to DEVICE by the tests)."""

    kv_cache: torch.Tensor  # [2, num_blocks, block_size, head_dim]
    block_tables: torch.Tensor  # [rows, num_kv_heads, max_blocks] int32
    lens: torch.Tensor  # [rows, num_kv_heads] int32

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[2]

    def slots(self, r: int, h: int, lo: int, hi: int) -> torch.Tensor:
        """Slots of logical indices [lo, hi) of (row r, KV head h).

        Example: block_size 4, table [7, 3, 9], indices [2, 6) -> slots [30, 31, 12, 13].
        """
        idx = torch.arange(lo, hi)
        bs = self.block_size
        return self.block_tables[r, h, idx // bs].long() * bs + idx % bs


def random_lens(rows: int, num_kv_heads: int, max_len: int, block_size: int, seed: int):
    """[rows, num_kv_heads] int32 lengths in [0, max_len], with a 0, a 1, a multiple of the
    block size and max_len among them (the rest rarely multiples of the block size)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, max_len + 1, (rows, num_kv_heads), generator=gen, dtype=torch.int32)
    special = [0, max_len, 3 * block_size, 1]
    flat = lens.view(-1)
    for i, v in enumerate(special[: flat.numel()]):
        flat[(i * 5) % flat.numel()] = v
    return lens


def make_head_cache(
    lens: torch.Tensor,  # [rows, num_kv_heads] int32
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    spare_blocks: int = 4,
) -> HeadCache:
    """Random K/V; (row, head) gets ceil(len / block_size) distinct random blocks; the table
    columns past them point at spare blocks (in no table: never to be read)."""
    gen = torch.Generator().manual_seed(seed)
    rows, heads = lens.shape
    nblk = (lens.long() + block_size - 1) // block_size  # [rows, heads]
    num_blocks = int(nblk.sum()) + spare_blocks
    max_blocks = int(nblk.max()) + 1
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    spare = perm[num_blocks - spare_blocks :]
    pick = torch.randint(0, spare_blocks, (rows, heads, max_blocks), generator=gen)
    tables = spare[pick]  # [rows, heads, max_blocks]
    used = 0
    for r in range(rows):
        for h in range(heads):
            n = int(nblk[r, h])
            tables[r, h, :n] = perm[used : used + n]
            used += n
    kv = torch.randn(2, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    return HeadCache(kv_cache=kv, block_tables=tables, lens=lens.clone())


def poisoned(c: HeadCache, visible_lo: torch.Tensor, early: float) -> torch.Tensor:
    """A copy of the cache where every slot outside each head's [0, len) holds NaN and the
    slots of logical indices [0, visible_lo[r, h]) hold ``early`` (NaN or a finite value)."""
    kv = c.kv_cache.clone()
    flat = kv.view(2, -1, kv.shape[-1])  # [2, num_slots, head_dim]
    live = torch.zeros(flat.shape[1], dtype=torch.bool)
    early_mask = torch.zeros_like(live)
    rows, heads = c.lens.shape
    for r in range(rows):
        for h in range(heads):
            n, lo = int(c.lens[r, h]), int(visible_lo[r, h])
            live[c.slots(r, h, lo, n)] = True
            early_mask[c.slots(r, h, 0, lo)] = True
    flat[:, ~live & ~early_mask] = float("nan")
    flat[:, early_mask] = early
    return kv


# ---------------------------------------------------------------------------------------------
# References (float32, one (row, head) at a time)
# ---------------------------------------------------------------------------------------------


def decode_ref(
    query: torch.Tensor,  # [rows, num_heads, head_dim]
    c: HeadCache,
    scale: float,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns the output [rows, num_heads, head_dim] float32, the attended slots
    [num_slots] bool and each slot's score increment [num_slots] float32 (sum over the GQA
    group of p^2; one addend per slot, as each slot belongs to one head)."""
    rows, num_heads, head_dim = query.shape
    heads = c.lens.shape[1]
    g = num_heads // heads
    k_flat = c.kv_cache[0].reshape(-1, head_dim)
    v_flat = c.kv_cache[1].reshape(-1, head_dim)
    out = torch.zeros(rows, num_heads, head_dim)
    attended = torch.zeros(k_flat.shape[0], dtype=torch.bool)
    delta = torch.zeros(k_flat.shape[0])
    for r in range(rows):
        for h in range(heads):
            n = int(c.lens[r, h])
            lo = max(n - window, 0) if window else 0
            if n == lo:
                continue
            slots = c.slots(r, h, lo, n)
            q = query[r, h * g : (h + 1) * g].float()  # [G, D]
            p = torch.softmax(q @ k_flat[slots].float().T * scale, dim=-1)  # [G, n - lo]
            out[r, h * g : (h + 1) * g] = p @ v_flat[slots].float()
            attended[slots] = True
            delta[slots] = (p * p).sum(0)
    return out, attended, delta


def paged_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    c: HeadCache,
    q_lens: list[int],
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Causal attention of request r's q_lens[r] queries (the last q_len logical indices of
    each head); rows of no request are 0. Returns [num_tokens, num_heads, head_dim] float32."""
    num_tokens, num_heads, head_dim = query.shape
    heads = c.lens.shape[1]
    g = num_heads // heads
    k_flat = c.kv_cache[0].reshape(-1, head_dim)
    v_flat = c.kv_cache[1].reshape(-1, head_dim)
    out = torch.zeros(num_tokens, num_heads, head_dim)
    start = 0
    for r, ql in enumerate(q_lens):
        for h in range(heads):
            n = int(c.lens[r, h])
            idx = torch.arange(n)
            q_idx = torch.arange(n - ql, n)  # [ql] logical index of each query
            vis = idx[None, :] <= q_idx[:, None]  # [ql, n]
            if window:
                vis &= idx[None, :] > q_idx[:, None] - window
            slots = c.slots(r, h, 0, n)
            k = k_flat[slots].float()
            v = v_flat[slots].float()
            k[~vis.any(0)] = 0.0  # keys no query sees may be poisoned: keep them out
            v[~vis.any(0)] = 0.0
            q = query[start : start + ql, h * g : (h + 1) * g].float()  # [ql, G, D]
            s = torch.einsum("igd,nd->ign", q, k) * scale
            s = s.masked_fill(~vis[:, None, :], float("-inf"))
            out[start : start + ql, h * g : (h + 1) * g] = torch.einsum(
                "ign,nd->igd", s.softmax(dim=-1), v
            )
        start += ql
    return out


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------


def check_decode(
    c: HeadCache,
    query: torch.Tensor,  # [rows, num_heads, head_dim] (CPU)
    scale: float,
    window: int | None,
    splits: tuple[int | None, ...],
    with_scores: bool,
    seed: int,
    tile_config: TileConfig | None = TILE,
    min_split_tiles: int = 1,
    long_tiles: int = 0,
) -> None:
    """kvc_decode_attention with each split count against :func:`decode_ref`; with scores,
    starting each time from random scores."""
    lo = (c.lens - window).clamp(min=0) if window else torch.zeros_like(c.lens)
    kv = poisoned(c, lo, float("nan")).to(DEVICE)
    tables, lens = c.block_tables.to(DEVICE), c.lens.to(DEVICE)
    ref, attended, delta = decode_ref(query, c, scale, window)
    g = query.shape[1] // c.lens.shape[1]
    empty = (c.lens == 0).repeat_interleave(g, dim=1)  # [rows, num_heads]
    atol, rtol = TOL[query.dtype]
    gen = torch.Generator().manual_seed(seed)
    for num_splits in splits:
        start = torch.rand(kv.shape[1] * kv.shape[2], generator=gen)
        scores = start.clone().to(DEVICE) if with_scores else None
        out = kvc_decode_attention(
            query.to(DEVICE), kv, tables, lens, scale, scores=scores, sliding_window=window,
            num_splits=num_splits, tile_config=tile_config, min_split_tiles=min_split_tiles,
            long_tiles=long_tiles,
        )  # fmt: skip
        assert out.dtype == query.dtype and out.shape == query.shape
        got = out.float().cpu()
        assert torch.isfinite(got).all()
        assert (got[empty] == 0).all(), "a head with no key must give 0"
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)
        if scores is not None:
            got_s = scores.cpu()
            assert torch.equal(got_s[~attended], start[~attended]), "a slot not attended changed"
            torch.testing.assert_close(
                got_s[attended], (start + delta)[attended], atol=SCORE_TOL[0], rtol=SCORE_TOL[1]
            )


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", PARAMS)
def test_decode(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Single pass and split-K (4 splits: with short heads some splits are empty), windows on
    and off, with scores; then both paths once without scores."""
    rows, max_len = (6, 3000) if CUDA else (3, 45)
    lens = random_lens(rows, num_kv_heads, max_len, block_size, seed=1)
    c = make_head_cache(lens, head_dim, block_size, dtype, seed=2)
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(rows, num_heads, head_dim, generator=gen).to(dtype)
    scale = 0.7 * head_dim**-0.5
    windows = (None, 10, 1000) if CUDA else (None, 10)
    splits = (1, 4, 16) if CUDA else (1, 4)
    for i, window in enumerate(windows):
        check_decode(c, query, scale, window, splits, with_scores=True, seed=10 + i)
    check_decode(c, query, scale, None, (1, 4), with_scores=False, seed=0)


@pytest.mark.parametrize("dtype", DTYPES if CUDA else [torch.bfloat16, torch.float32], ids=str)
def test_decode_auto_splits(dtype: torch.dtype) -> None:
    """num_splits=None: few long heads take split-K, many rows the single pass; both right."""
    block_size = BLOCK_SIZES[0]
    tile_n = TILE.tile_n if TILE else 64
    for rows, heads, max_len, split in ((1, 2, 4000 if CUDA else 60, True), (80, 4, 40, False)):
        if not CUDA and not split:
            rows = 8  # 32 programs >= 2 per "SM" (the interpreter counts 4)
        lens = random_lens(rows, heads, max_len, block_size, seed=4)
        c = make_head_cache(lens, 64, block_size, dtype, seed=5)
        capacity = c.block_tables.shape[2] * block_size
        n = kvc_decode_num_splits(rows, heads, capacity, DEVICE, tile_n)
        assert (n > 1) == split, n
        query = torch.randn(rows, 2 * heads, 64, generator=torch.Generator().manual_seed(6))
        check_decode(c, query.to(dtype), 64**-0.5, None, (None,), with_scores=True, seed=7)


def uneven_lens(rows: int, heads: int, short: int, long: int, seed: int) -> torch.Tensor:
    """[rows, heads] lengths as KV-Compress leaves them: most heads short, one head of each
    row long, a few empty."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, short + 1, (rows, heads), generator=gen, dtype=torch.int32)
    lens[torch.arange(rows), torch.randint(0, heads, (rows,), generator=gen)] = long
    lens.view(-1)[::7] = 0
    return lens


@pytest.mark.parametrize("dtype", DTYPES if CUDA else [torch.bfloat16, torch.float32], ids=str)
def test_decode_uneven_heads_split_by_least_tiles(dtype: torch.dtype) -> None:
    """Split-K with at least ``min_split_tiles`` tiles a split: a short head is split 0's alone
    (its other splits empty), a long one spans several splits; outputs and scores equal the
    reference with windows on and off, and at least 1 tile a split; and with
    ``long_tiles`` (the single pass for heads of at most that many tiles, split 0 of longer
    ones, their other splits and scores in persistent kernels, the last split of a head
    combining it; splits shorter than the threshold too)."""
    block_size = BLOCK_SIZES[0]
    rows, heads, short, long = (12, 4, 300, 5000) if CUDA else (4, 2, 20, 300)
    lens = uneven_lens(rows, heads, short, long, seed=8)
    c = make_head_cache(lens, 64, block_size, dtype, seed=9)
    query = torch.randn(rows, 2 * heads, 64, generator=torch.Generator().manual_seed(10))
    tiles = 4 if CUDA else 2  # a short head fits in that many tiles, a long one does not
    for i, window in enumerate((None, 50 if CUDA else 7)):
        for m, long_tiles in ((1, 0), (tiles, 0), (tiles, tiles), (1, tiles)):
            check_decode(c, query.to(dtype), 64**-0.5, window, (8,), with_scores=True,
                         seed=11 + i, min_split_tiles=m, long_tiles=long_tiles)  # fmt: skip
    for splits in (2, 4):  # (2: one split besides split 0; the last to finish combines)
        check_decode(c, query.to(dtype), 64**-0.5, None, (splits,), with_scores=splits == 2,
                     seed=13, min_split_tiles=tiles, long_tiles=tiles)  # fmt: skip


def test_decode_auto_splits_uneven_heads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scored rows that fill the SMs split their long heads with ``SKEW_SPLITS`` (none without
    scores, nor with ``SKEW_SPLITS`` None); every way gives the reference's output."""
    import pagedllm.ops.kvc_attention.decode as kvc_ops

    block_size = BLOCK_SIZES[0]
    rows, heads, short, long = (200, 4, 60, 3000) if CUDA else (8, 4, 20, 90)
    lens = uneven_lens(rows, heads, short, long, seed=12)
    c = make_head_cache(lens, 64, block_size, torch.float32, seed=13)
    capacity = c.block_tables.shape[2] * block_size
    tile_n = TILE.tile_n if TILE else 64
    assert kvc_decode_num_splits(rows, heads, capacity, DEVICE, tile_n) == 1
    query = torch.randn(rows, 2 * heads, 64, generator=torch.Generator().manual_seed(14))
    calls = []
    real = kvc_ops._long_split_kernel

    class Spy:  # records the long heads' launches (NUM_SPLITS and MIN_TILES)
        def __getitem__(self, grid):
            def launch(*args, **kw):
                calls.append((kw["NUM_SPLITS"], kw["MIN_TILES"]))
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(kvc_ops, "_long_split_kernel", Spy())
    monkeypatch.setattr(kvc_ops, "SKEW_SPLITS", kvc_ops.SkewSplits(8, 2, 2))
    check_decode(c, query, 64**-0.5, None, (None,), with_scores=True, seed=15)
    assert calls == [(8, 2)]
    check_decode(c, query, 64**-0.5, None, (None,), with_scores=False, seed=16)
    assert len(calls) == 1  # without scores: the single pass
    monkeypatch.setattr(kvc_ops, "SKEW_SPLITS", None)
    check_decode(c, query, 64**-0.5, None, (None,), with_scores=True, seed=17)
    assert len(calls) == 1


def test_decode_strided_inputs() -> None:
    """Strided views (query, tables, int64 lengths) as the backend may pass them, the default
    tile shape, and query rows past the last length row (they come back 0)."""
    block_size, heads, num_heads, d = BLOCK_SIZES[1], 2, 8, 64
    lens = random_lens(4, heads, 50, block_size, seed=8)
    c = make_head_cache(lens, d, block_size, torch.float32, seed=9)
    gen = torch.Generator().manual_seed(10)
    q_big = torch.randn(6, num_heads, 2 * d, generator=gen)
    query = q_big[:, :, :d]  # [6, num_heads, d], stride(1) = 2 d
    ref, _, _ = decode_ref(query[:4], c, d**-0.5, None)
    tables_big = torch.zeros(8, heads, c.block_tables.shape[2] + 3, dtype=torch.int32)
    tables_big[::2, :, 1 : 1 + c.block_tables.shape[2]] = c.block_tables
    tables = tables_big[::2, :, 1:]  # every stride differs from a contiguous tensor's
    lens_big = torch.zeros(4, 2 * heads, dtype=torch.int64)
    lens_big[:, ::2] = lens
    kv = c.kv_cache.to(DEVICE)
    for s in (1, 4):
        out = kvc_decode_attention(
            query.to(DEVICE), kv, tables.to(DEVICE), lens_big.to(DEVICE)[:, ::2], d**-0.5,
            num_splits=s,
        )  # fmt: skip
        got = out.cpu()
        torch.testing.assert_close(got[:4], ref, atol=1e-4, rtol=1e-4)
        assert (got[4:] == 0).all()


def test_decode_row_ids() -> None:
    """``row_ids``: query rows read chosen rows of whole tables (as the CUDA graphs do, a pad
    row with every head empty among them): equal to the gathered tables, the pad row's
    output 0 and no score touched by it; single pass and split-K."""
    block_size, heads, num_heads, d = BLOCK_SIZES[0], 2, 8, 64
    lens = random_lens(6, heads, 300 if CUDA else 40, block_size, seed=11)
    lens[5] = 0  # the pad row
    c = make_head_cache(lens, d, block_size, torch.float32, seed=12)
    ids = torch.tensor([4, 1, 5, 2])
    sub = HeadCache(c.kv_cache, c.block_tables[ids], c.lens[ids])
    gen = torch.Generator().manual_seed(13)
    query = torch.randn(4, num_heads, d, generator=gen)
    ref, attended, delta = decode_ref(query, sub, d**-0.5, None)
    kv = c.kv_cache.to(DEVICE)
    for s in (1, 4):
        start = torch.rand(kv.shape[1] * block_size, generator=gen)
        scores = start.clone().to(DEVICE)
        out = kvc_decode_attention(
            query.to(DEVICE), kv, c.block_tables.to(DEVICE), c.lens.to(DEVICE), d**-0.5,
            scores=scores, num_splits=s, row_ids=ids.to(DEVICE),
        )  # fmt: skip
        got = out.cpu()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert (got[2] == 0).all()
        got_s = scores.cpu()
        assert torch.equal(got_s[~attended], start[~attended])
        torch.testing.assert_close(
            got_s[attended], (start + delta)[attended], atol=SCORE_TOL[0], rtol=SCORE_TOL[1]
        )
    # per-row flags: table row 4 (query row 0) is not scored, the others are
    scored = torch.tensor([1, 1, 1, 1, 0, 1], dtype=torch.int32)
    rest = HeadCache(c.kv_cache, c.block_tables[ids[1:]], c.lens[ids[1:]])
    _, attended_rest, delta_rest = decode_ref(query[1:], rest, d**-0.5, None)
    for s in (1, 4):
        start = torch.rand(kv.shape[1] * block_size, generator=gen)
        scores = start.clone().to(DEVICE)
        out = kvc_decode_attention(
            query.to(DEVICE), kv, c.block_tables.to(DEVICE), c.lens.to(DEVICE), d**-0.5,
            scores=scores, num_splits=s, row_ids=ids.to(DEVICE), scored=scored.to(DEVICE),
        )  # fmt: skip
        torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
        got_s = scores.cpu()
        assert torch.equal(got_s[~attended_rest], start[~attended_rest])
        torch.testing.assert_close(
            got_s[attended_rest], (start + delta_rest)[attended_rest], atol=SCORE_TOL[0],
            rtol=SCORE_TOL[1],
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Mixed batches (prefill chunks and decodes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", PARAMS)
def test_paged_mixed_batch(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Prefill chunks (after per-head contexts of any length, 0 included) and decodes; two
    CUDA-graph padding rows at the end must come back 0."""
    if CUDA:
        q_lens, max_ctx = [1, 130, 1, 37, 300, 16], 1500
    else:
        q_lens, max_ctx = [1, 6, 3, 1], 25
    pad = 2
    ctx = random_lens(len(q_lens), num_kv_heads, max_ctx, block_size, seed=11)
    lens = ctx + torch.tensor(q_lens, dtype=torch.int32)[:, None]  # [R, H]
    c = make_head_cache(lens, head_dim, block_size, dtype, seed=12)
    n_tok = sum(q_lens)
    gen = torch.Generator().manual_seed(13)
    query = torch.randn(n_tok + pad, num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    scale = head_dim**-0.5
    ql = torch.tensor(q_lens, dtype=torch.int32)[:, None]
    atol, rtol = TOL[dtype]
    for window in (None, 8, 200) if CUDA else (None, 5):
        ref = paged_ref(query, c, q_lens, scale, window)
        # No query of (r, h) sees indices <= len - q_len - W; the unified kernel may load (not
        # use) those of its first tile: poison them with a finite value, the rest with NaN.
        lo = (lens - ql - window + 1).clamp(min=0) if window else torch.zeros_like(lens)
        kv = poisoned(c, lo, 1e3).to(DEVICE)
        out = kvc_paged_attention(
            query.to(DEVICE),
            kv,
            qsl.to(DEVICE),
            lens.to(DEVICE),
            c.block_tables.to(DEVICE),
            max(q_lens),
            scale,
            window,
            tile_config=TILE,
        )
        assert out.dtype == dtype and out.shape == query.shape
        got = out.float().cpu()
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got[:n_tok], ref[:n_tok], atol=atol, rtol=rtol)
        assert (got[n_tok:] == 0).all(), "rows of no request must be 0"


def test_paged_matches_decode_for_decode_rows() -> None:
    """A batch of q_len 1 through both entry points gives the same output."""
    block_size, heads, num_heads, d = BLOCK_SIZES[0], 2, 8, 64
    lens = random_lens(3, heads, 40, block_size, seed=14) + 1  # every head has its new key
    c = make_head_cache(lens, d, block_size, torch.float32, seed=15)
    query = torch.randn(3, num_heads, d, generator=torch.Generator().manual_seed(16)).to(DEVICE)
    kv, tables, lens_d = c.kv_cache.to(DEVICE), c.block_tables.to(DEVICE), lens.to(DEVICE)
    qsl = torch.arange(4, dtype=torch.int32, device=DEVICE)
    for window in (None, 6):
        a = kvc_decode_attention(query, kv, tables, lens_d, 0.1, sliding_window=window)
        b = kvc_paged_attention(query, kv, qsl, lens_d, tables, 1, 0.1, sliding_window=window)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _layer_view(c: HeadCache, order: torch.Tensor, layers: int, layer: int):
    """The cache's tables and lengths as the backend passes them: table row ``order[i]`` holds
    row i of ``c``, inside [rows, layers * H, max_blocks] / [rows, layers * H] tensors of which
    this layer's H heads are a strided view. Returns (tables, lens) views, one spare row more
    (never read)."""
    rows, h = c.lens.shape
    n = rows + 1
    tables = torch.zeros(n, layers * h, c.block_tables.shape[2], dtype=torch.int32)
    lens = torch.zeros(n, layers * h, dtype=torch.int64)
    part = slice(layer * h, (layer + 1) * h)
    tables[order, part] = c.block_tables
    lens[order, part] = c.lens.long()
    return tables[:, part], lens[:, part]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_paged_rows_in_place(dtype: torch.dtype) -> None:
    """``row_ids``, ``q_start`` and ``out``: chunks whose query rows lie among other rows (a
    mixed step's decodes), in table rows of their own order, over one layer's strided view of
    the whole tables, write only their rows of ``out``; the rest keep their values. Equal to
    the reference on the chunks gathered."""
    num_heads, h, d, bs = 8, 2, 64, BLOCK_SIZES[1]
    if CUDA:
        q_lens, max_ctx = [130, 7, 300, 2], 900
    else:
        q_lens, max_ctx = [6, 3, 9, 2], 30
    ctx = random_lens(len(q_lens), h, max_ctx, bs, seed=30)
    lens = ctx + torch.tensor(q_lens, dtype=torch.int32)[:, None]
    c = make_head_cache(lens, d, bs, dtype, seed=31)
    # step layout: [decode, chunk 0, decode, decode, chunk 1, chunk 2, decode, chunk 3]
    gaps = [1, 2, 0, 1]
    starts, row = [], 0
    for gap, ql in zip(gaps, q_lens):
        row += gap
        starts.append(row)
        row += ql
    t = row + 1
    gen = torch.Generator().manual_seed(32)
    query = torch.randn(t, num_heads, d, generator=gen).to(dtype)
    chunk_rows = torch.cat([torch.arange(a, a + n) for a, n in zip(starts, q_lens)])
    sub_qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int64)
    order = torch.tensor([3, 0, 4, 1])  # chunk i's table row
    tables, lens_v = _layer_view(c, order, layers=3, layer=1)
    assert not tables.is_contiguous() and not lens_v.is_contiguous()
    atol, rtol = TOL[dtype]
    for window in (None, 5):
        ref = paged_ref(query[chunk_rows], c, q_lens, d**-0.5, window)
        lo = (lens - torch.tensor(q_lens)[:, None] - window + 1).clamp(min=0) if window else (
            torch.zeros_like(lens))  # fmt: skip
        kv = poisoned(c, lo, 1e3).to(DEVICE)
        sentinel = torch.full((t, num_heads, d), 7.0).to(dtype).to(DEVICE)
        out = sentinel.clone()
        got = kvc_paged_attention(
            query.to(DEVICE), kv, sub_qsl.to(DEVICE), lens_v.to(DEVICE), tables.to(DEVICE),
            max(q_lens), d**-0.5, window, row_ids=order.to(DEVICE),
            q_start=torch.tensor(starts).to(DEVICE), out=out,
            num_chunk_tokens=sum(q_lens), tile_config=TILE,
        )  # fmt: skip
        assert got is out
        got = out.float().cpu()
        torch.testing.assert_close(got[chunk_rows], ref, atol=atol, rtol=rtol)
        others = torch.ones(t, dtype=torch.bool)
        others[chunk_rows] = False
        assert (got[others] == 7.0).all(), "a row of no chunk was written"


@pytest.mark.parametrize("num_splits", [1, 4, "long"])
def test_decode_rows_in_place(num_splits: int | str) -> None:
    """``q_rows`` and ``out``: decode rows at chosen rows of a mixed step's query read and
    write only those rows of ``out``; output and scores equal the reference on the gathered
    rows (single pass, split-K, and only the heads longer than 2 tiles split)."""
    long = dict(num_splits=4, min_split_tiles=1, long_tiles=2)
    kw = long if num_splits == "long" else dict(num_splits=num_splits)
    block_size, heads, num_heads, d = BLOCK_SIZES[0], 2, 8, 64
    lens = random_lens(5, heads, 300 if CUDA else 40, block_size, seed=33)
    c = make_head_cache(lens, d, block_size, torch.float32, seed=34)
    ids = torch.tensor([4, 1, 2])  # table rows of the decodes
    q_rows = torch.tensor([6, 0, 3])  # their query rows in a step of 8 tokens
    sub = HeadCache(c.kv_cache, c.block_tables[ids], c.lens[ids])
    gen = torch.Generator().manual_seed(35)
    query = torch.randn(8, num_heads, d, generator=gen)
    ref, attended, delta = decode_ref(query[q_rows], sub, d**-0.5, None)
    start = torch.rand(c.kv_cache.shape[1] * block_size, generator=gen)
    scores = start.clone().to(DEVICE)
    out = torch.full((8, num_heads, d), 7.0, device=DEVICE)
    kvc_decode_attention(
        query.to(DEVICE), c.kv_cache.to(DEVICE), c.block_tables.to(DEVICE), c.lens.to(DEVICE),
        d**-0.5, scores=scores, row_ids=ids.to(DEVICE), q_rows=q_rows.to(DEVICE), out=out,
        tile_config=TILE, **kw,
    )  # fmt: skip
    got = out.cpu()
    torch.testing.assert_close(got[q_rows], ref, atol=1e-4, rtol=1e-4)
    others = torch.ones(8, dtype=torch.bool)
    others[q_rows] = False
    assert (got[others] == 7.0).all(), "a row of no decode was written"
    got_s = scores.cpu()
    assert torch.equal(got_s[~attended], start[~attended])
    torch.testing.assert_close(
        got_s[attended], (start + delta)[attended], atol=SCORE_TOL[0], rtol=SCORE_TOL[1]
    )


@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,maxpool",
    [
        (torch.float32, 8, 2, 3),
        (torch.float32, 4, 1, 31),  # the default kernel: wider than a 16-key block
        (torch.bfloat16, 8, 2, 0),
        pytest.param(torch.bfloat16, 32, 8, 7, marks=cuda_only),  # Llama-3.1-8B's heads
        pytest.param(torch.float16, 16, 16, 7, marks=cuda_only),
    ],
    ids=str,
)
def test_window_scores(dtype: torch.dtype, num_heads: int, num_kv_heads: int, maxpool: int) -> None:
    """A step's prompt-ending chunks score their keys from their last queries
    (``kvc_window_scores``, from the softmax normalizers ``kvc_paged_attention`` stores with
    ``lse``) as ``prefill_window_scores_batched`` does: the same scores slot for slot, no
    other slot touched; each chunk row's stored normalizer is its logsumexp (log2 units).
    Chunks of several requests, heads of different lengths, window queries fewer than the
    widest (C) for some, one chunk shorter than its window, decode rows between them, more
    window rows (queries x group) than one dot takes."""
    from pagedllm.kvcompress.attention import prefill_window_scores_batched
    from pagedllm.ops.kvc_attention import kvc_window_scores

    bs, d = BLOCK_SIZES[1], 128 if CUDA else 64
    if CUDA:
        q_lens, max_ctx, collect = [1, 300, 1, 64, 1200, 1, 20], 1500, [0, 32, 0, 32, 17, 0, 32]
    else:
        # 40 window queries x G 4: 160 rows, two dots a key tile (at most 128 rows each)
        q_lens, max_ctx, collect = [1, 9, 1, 5, 40, 3], 30, [0, 4, 0, 2, 40, 4]
    r = len(q_lens)
    ctx = random_lens(r, num_kv_heads, max_ctx, bs, seed=41)
    ql = torch.tensor(q_lens, dtype=torch.int32)[:, None]
    lens = ctx + ql  # [R, H]
    c = make_head_cache(lens, d, bs, dtype, seed=42)
    gen = torch.Generator().manual_seed(43)
    n_tok = sum(q_lens)
    query = torch.randn(n_tok, num_heads, d, generator=gen).to(dtype)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    prefill = np.nonzero(np.asarray(q_lens) > 1)[0]
    collect_np = np.minimum(np.asarray(collect), np.asarray(q_lens))  # a chunk's rows at most
    index = KVCStepPlan.index_arrays(
        np.nonzero(np.asarray(q_lens) == 1)[0], prefill, qsl, np.arange(r), collect_np
    )
    t = {k: torch.from_numpy(np.asarray(v)).long() for k, v in index.items()}
    scale = d**-0.5
    kv = poisoned(c, torch.zeros_like(lens), float("nan"))
    lse = torch.full((n_tok, num_heads), float("nan"), device=DEVICE)
    on = {k: v.to(DEVICE) for k, v in t.items()}
    kvc_paged_attention(
        query.to(DEVICE), kv.to(DEVICE), on["prefill_qsl"], lens.to(DEVICE),
        c.block_tables.to(DEVICE), int(max(q_lens)), scale, row_ids=on["prefill_table_rows"],
        q_start=on["prefill_q_start"], tile_config=TILE,
        out=torch.zeros(query.shape, dtype=dtype, device=DEVICE), lse=lse,
    )  # fmt: skip
    got_lse = lse.cpu()
    g = num_heads // num_kv_heads
    for i in prefill:  # each chunk row's logsumexp over the keys it sees, in log2 units
        for h in range(num_kv_heads):
            keys = c.kv_cache[0].view(-1, d)[c.slots(int(i), h, 0, int(lens[i, h]))].float()
            rows = slice(int(qsl[i]), int(qsl[i + 1]))
            logits = query[rows, h * g : (h + 1) * g].float() @ keys.T * scale  # [q, G, S]
            own = int(ctx[i, h]) + torch.arange(q_lens[i])  # each query's own index
            logits = logits.masked_fill(torch.arange(keys.shape[0]) > own[:, None, None],
                                        float("-inf"))  # fmt: skip
            ref = torch.logsumexp(logits, -1) / math.log(2.0)
            torch.testing.assert_close(got_lse[rows, h * g : (h + 1) * g], ref, atol=2e-3,
                                       rtol=1e-4)  # fmt: skip
    win = t["window_reqs"]
    max_len = int(lens[win].max())
    start = torch.rand(kv.shape[1] * bs, generator=gen)
    ref_scores = start.clone()
    prefill_window_scores_batched(
        query.float(), c.kv_cache[0].float().view(-1, d), c.block_tables[win], lens[win],
        t["window_rows"], t["window_mask"].bool(), bs, scale, ref_scores, maxpool, max_len,
    )  # fmt: skip
    scores = start.clone().to(DEVICE)
    kvc_window_scores(
        query.to(DEVICE), kv.to(DEVICE), lse, c.block_tables.to(DEVICE), lens.to(DEVICE),
        on["window_reqs"], on["window_rows"], on["window_n"], scale, scores, maxpool, max_len,
    )  # fmt: skip
    got = scores.cpu()
    scored = torch.zeros_like(start, dtype=torch.bool)
    for i in win.tolist():
        for h in range(num_kv_heads):
            scored[c.slots(i, h, 0, int(lens[i, h]))] = True
    assert torch.equal(got[~scored], start[~scored]), "a slot of no scoring head changed"
    assert (ref_scores[scored] != start[scored]).any()
    atol = 1e-6 if dtype == torch.float32 else 2e-4
    torch.testing.assert_close(got[scored], ref_scores[scored], atol=atol, rtol=2e-3)


# ---------------------------------------------------------------------------------------------
# The backend: KVCTritonBackend against KVCTorchBackend on one step
# ---------------------------------------------------------------------------------------------


def _kvc_step(
    q_lens: list[int],
    ctx: torch.Tensor,  # [R, H] int32 keys each head holds before the step
    num_heads: int,
    head_dim: int,
    block_size: int,
    compressible: bool,
    dev: torch.device,
    table_rows: list[int] | None = None,
    verify: list[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(query, key, value, kv_cache, metadata) of one KV-Compress step on ``dev``, the metadata
    as ``HeadPagedCache.prepare_step`` / ``finish_metadata`` make it (float32, the same data
    for every ``dev``).
    Request i sits in row ``table_rows[i]`` of the tables (i without them); rows of no request
    hold no key. ``verify[i]``: request i's row verifies drafts (it keeps its queries, request
    id ``str(i)``; every other chunk ends its prompt)."""
    r, h = ctx.shape
    rows = np.arange(r) if table_rows is None else np.asarray(table_rows)
    n_rows = int(rows.max()) + 1
    lens_req = ctx + torch.tensor(q_lens, dtype=torch.int32)[:, None]  # [R, H]
    lens = torch.zeros(n_rows, h, dtype=torch.int32)
    lens[torch.from_numpy(rows)] = lens_req  # [rows, H]
    c = make_head_cache(lens, head_dim, block_size, torch.float32, seed=20)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    t = int(qsl[-1])
    req = torch.from_numpy(np.repeat(np.arange(r), q_lens))
    trow = torch.from_numpy(rows)[req]  # [T] table row of each token
    local = torch.arange(t) - torch.from_numpy(qsl)[req]
    # Example: ctx[r, h] 5, q_len 2 -> the new keys are logical 5, 6 of head h.
    idx = ctx[req].long() + local[:, None]  # [T, H]
    blk = c.block_tables[trow[:, None], torch.arange(h)[None, :], idx // block_size].long()
    slots = blk * block_size + idx % block_size  # [T, H]
    num_slots = c.kv_cache.shape[1] * block_size
    positions = torch.zeros(num_slots, dtype=torch.int32)
    for rr, hh in itertools.product(range(n_rows), range(h)):
        n = int(lens[rr, hh])
        positions[c.slots(rr, hh, 0, n)] = torch.arange(n, dtype=torch.int32)
    q_np = np.asarray(q_lens)
    decode, prefill = np.nonzero(q_np == 1)[0], np.nonzero(q_np > 1)[0]
    collect = np.where(q_np == 1, 1, np.minimum(4, q_np))  # every chunk ends its prompt
    ver = np.zeros(r, dtype=bool) if verify is None else np.asarray(verify)
    collect[ver] = 0
    index = KVCStepPlan.index_arrays(decode, prefill, qsl, rows, collect)
    max_lens = lens_req.max(1).values.numpy()
    stash = None
    if ver.any():
        keep = np.flatnonzero(ver)
        count = q_np[keep]
        stash = VerifyQueries(
            [str(i) for i in keep], np.cumsum(count) - count, count, max_lens[keep],
            np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in keep]),
        )  # fmt: skip
        index["stash_rows"] = stash.rows
    win = prefill[collect[prefill] > 0]
    plan = KVCStepPlan(
        decode=decode,
        prefill=prefill,
        collect=collect,
        maxpool_kernel=3,
        rows=rows,
        max_lens=max_lens,
        prefill_max_q=int(q_np[prefill].max()) if len(prefill) else 0,
        window_max_len=int(max_lens[win].max()) if len(win) else 0,
        tensors={k: torch.from_numpy(v).long().to(dev) for k, v in index.items()},
        prefill_tokens=int(index["prefill_qsl"][-1]),
        stash=stash,
    )
    gen = torch.Generator().manual_seed(21)
    scores = torch.rand(num_slots, generator=gen)
    token_positions = ctx[req, 0].long() + local
    info = KVCLayerInfo(
        scores.to(dev),
        positions.to(dev),
        token_positions.to(dev),
        compressible,
        plan,
        torch.from_numpy(rows).to(dev),
    )
    md = AttentionMetadata(
        num_reqs=r,
        num_actual_tokens=t,
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
        seq_lens=lens.long().to(dev),
        slot_mapping=slots.to(dev),
        block_tables=c.block_tables.to(dev),
        max_query_len=int(q_np.max()),
        max_seq_len=int(lens.max()),
        block_size=block_size,
        query_start_loc_np=qsl,
        kvc=info,
    )
    query = torch.randn(t, num_heads, head_dim, generator=gen)
    key = torch.randn(t, h, head_dim, generator=gen)
    value = torch.randn(t, h, head_dim, generator=gen)
    return query.to(dev), key.to(dev), value.to(dev), c.kv_cache.to(dev), md


@pytest.mark.parametrize(
    "q_lens,window,compressible,table_rows",
    [
        ([1, 6, 1, 3], None, True, None),  # decodes and prompt-ending chunks, scored
        ([1, 1, 1], None, True, None),  # a decode-only step: one kernel call
        ([5, 1, 2], 4, False, None),  # a windowed layer (never compacted, not scored)
        ([3, 1, 4, 1], None, True, [5, 2, 0, 3]),  # table rows in another order, gaps
        ([4, 7], None, True, [1, 0]),  # a prefill-only step
    ],
    ids=["mixed", "decode-only", "window", "mixed-rows", "prefill-only"],
)
def test_backend_matches_torch(
    q_lens: list[int], window: int | None, compressible: bool, table_rows: list[int] | None
) -> None:
    """KVCTritonBackend (kvc_decode_attention, kvc_paged_attention and the torch window
    scores, reading and writing the step's rows in place) against KVCTorchBackend: same
    cache after the write, same output and scores."""
    num_heads, h, d, bs = 8, 2, 64, BLOCK_SIZES[0]
    ctx = torch.tensor([[3, 20], [0, 0], [17, 5], [9, 40]], dtype=torch.int32)[: len(q_lens)]
    if not compressible:  # never compacted: every head of a request holds the same keys
        ctx = ctx[:, :1].expand(-1, h).contiguous()
    results = []
    for backend, dev in ((KVCTorchBackend(), torch.device("cpu")), (KVCTritonBackend(), DEVICE)):
        query, key, value, kv, md = _kvc_step(
            q_lens, ctx, num_heads, d, bs, compressible, dev, table_rows
        )
        out = backend.forward(query, key, value, kv, md, d**-0.5, window)
        assert out.shape == (query.shape[0], num_heads * d)
        results.append((out.cpu(), kv.cpu(), md.kvc.scores.cpu()))
    (ref, ref_kv, ref_scores), (got, got_kv, got_scores) = results
    assert torch.equal(got_kv, ref_kv)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_scores, ref_scores, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "q_lens,window,compressible",
    [([1, 6, 1, 3], None, True), ([1, 1, 1], None, True), ([5, 1, 2], 4, False)],
    ids=["mixed", "decode-only", "window"],
)
def test_backend_matches_torch_fp8(q_lens: list[int], window: int | None,
                                   compressible: bool) -> None:  # fmt: skip
    """An fp8 per-head cache (its codes as stored, each KV head with its own K and V scale,
    40x apart): KVCTritonBackend (the query scaled by K's scale, the output by V's) against
    KVCTorchBackend (fp8 x scale per head): the same cache after the step's write, the same
    output and scores."""
    from pagedllm.kv_layout import FP8

    num_heads, h, d, bs = 8, 2, 64, BLOCK_SIZES[0]
    ctx = torch.tensor([[3, 20], [0, 0], [17, 5], [9, 40]], dtype=torch.int32)[: len(q_lens)]
    if not compressible:
        ctx = ctx[:, :1].expand(-1, h).contiguous()
    kv_scale = torch.tensor([[0.05, 2.0], [0.03, 1.2]])  # [2, H]
    results = []
    for backend, dev in ((KVCTorchBackend(), torch.device("cpu")), (KVCTritonBackend(), DEVICE)):
        query, key, value, kv, md = _kvc_step(q_lens, ctx, num_heads, d, bs, compressible, dev)
        kv = kv.nan_to_num(0.0).to(FP8)  # the stored codes
        key, value = key * 4, value * 3
        out = backend.forward(query, key, value, kv, md, d**-0.5, window, kv_scale.to(dev))
        results.append((out.cpu(), kv.cpu().view(torch.uint8), md.kvc.scores.cpu()))
    (ref, ref_kv, ref_scores), (got, got_kv, got_scores) = results
    assert torch.equal(got_kv, ref_kv)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_scores, ref_scores, atol=1e-6, rtol=1e-5)


def test_verify_rows_keep_their_queries_and_score_as_decode_steps() -> None:
    """Rows verifying drafts (speculative decoding) score nothing in their step; both
    backends keep their queries (the Triton one with the prefill kernel's softmax
    normalizers). Once the rejected drafts' KVs are dropped, ``HeadPagedCache.score_verified``
    adds to each key of such a row's heads exactly what decode steps of its accepted queries
    (the first a + 1) would have - from the normalizers with the Triton window kernel, and
    recomputing the softmax in torch - and touches no other slot."""
    from pagedllm.config import KVCompressConfig
    from pagedllm.core.kv_cache.spec import HeadPagedSpec
    from pagedllm.kvcompress.cache import HeadPagedCache

    num_heads, h, d, bs = 8, 2, 64, BLOCK_SIZES[0]
    q_lens, verify = [1, 5, 3, 4], [False, True, True, False]  # row 3: a prompt's last chunk
    ctx = torch.tensor([[3, 20], [7, 2], [17, 5], [9, 40]], dtype=torch.int32)
    accepted = {"1": 2, "2": 1}  # queries of real tokens: the last known token + drafts kept
    scale = d**-0.5
    kept = []
    for backend, dev in ((KVCTorchBackend(), torch.device("cpu")), (KVCTritonBackend(), DEVICE)):
        query, key, value, kv, md = _kvc_step(q_lens, ctx, num_heads, d, bs, True, dev,
                                              verify=verify)  # fmt: skip
        before = md.kvc.scores.clone()
        backend.forward(query, key, value, kv, md, scale, None)
        stash = md.kvc.plan.stash
        assert stash is not None and stash.req_ids == ["1", "2"]
        torch.testing.assert_close(stash.q[0].cpu(), query[stash.rows].cpu(), rtol=0, atol=0)
        assert (stash.lse[0] is not None) == isinstance(backend, KVCTritonBackend)
        kept.append((stash, kv.cpu(), md.seq_lens.cpu(), md.block_tables.cpu(), before.cpu()))
        # the verify rows' heads: no score changed in their step
        c = HeadCache(kv.cpu(), md.block_tables.cpu(), md.seq_lens.cpu().int())
        for i, hh in itertools.product((1, 2), range(h)):
            slots = c.slots(i, hh, 0, int(c.lens[i, hh]))
            assert torch.equal(md.kvc.scores.cpu()[slots], before.cpu()[slots])
    (_, kv, lens, tables, start), _ = kept
    g = num_heads // h
    k_flat = kv[0].reshape(-1, d)
    # the reference: each accepted query's decode-step increments over the keys it saw
    delta = torch.zeros(k_flat.shape[0])
    query = kept[0][0].q[0]
    for w, rid in enumerate(["1", "2"]):
        i = int(rid)
        for j, hh in itertools.product(range(accepted[rid]), range(h)):
            q = query[int(kept[0][0].start[w]) + j, hh * g : (hh + 1) * g]  # [G, d]
            slots = HeadCache(kv, tables, lens.int()).slots(i, hh, 0, int(ctx[i, hh]) + j + 1)
            p = torch.softmax(q.float() @ k_flat[slots].T * scale, dim=-1)
            delta[slots] += (p * p).sum(0)
    trimmed = lens.clone()
    for rid, a in accepted.items():
        trimmed[int(rid)] -= q_lens[int(rid)] - a
    spec = HeadPagedSpec(bs, h, d, 4, num_layers=1, compressible=(True,))
    for stash, *_ in kept:
        cache = HeadPagedCache(spec, KVCompressConfig(enabled=True), torch.float32, DEVICE, 4,
                               tables.shape[2] * bs, [None])  # fmt: skip
        cache.allocate(kv.shape[1])
        cache.kv[:, : kv.shape[1]] = kv.to(DEVICE)
        cache.tables[:4, :, : tables.shape[2]] = tables.to(DEVICE)
        cache.lens[:4] = trimmed.to(DEVICE)
        cache.scores[: start.numel()] = start.to(DEVICE)
        cache.score_verified(stash, accepted, {str(i): i for i in range(4)})
        got = cache.scores[: start.numel()].cpu() - start
        torch.testing.assert_close(got, delta, atol=2e-6, rtol=1e-4)


def test_warm_up_decode_kernels_touches_nothing() -> None:
    """The start-up warm-up runs each decode variant a step can meet (split count x score
    pass x direct / q_rows rows) on the pad row: every launch returns, and no K, V, score or
    length changes."""
    from pagedllm.config import KVCompressConfig
    from pagedllm.core.kv_cache.spec import HeadPagedSpec
    from pagedllm.kvcompress.cache import HeadPagedCache
    from pagedllm.kvcompress.triton_backend import warm_up_decode_kernels

    dtype = torch.bfloat16 if CUDA else torch.float32
    # layer 0 full attention (compressible), layer 1 a 32-token window (keeps its KVs)
    spec = HeadPagedSpec(16, 2, 64, dtype.itemsize, num_layers=2, compressible=(True, False))
    cache = HeadPagedCache(
        spec, KVCompressConfig(enabled=True), dtype, DEVICE, 8, 256, [None, 32]
    )  # fmt: skip
    cache.allocate(40)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen, device=DEVICE).to(dtype))
    cache.scores.copy_(torch.rand(cache.scores.shape, generator=gen, device=DEVICE))
    before = (cache.kv.clone(), cache.scores.clone(), cache.lens.clone())
    launches = warm_up_decode_kernels(cache, num_heads=4, dtype=dtype, max_rows=8)
    if not CUDA:
        # the interpreter's 4 "SMs", 2 KV heads, tables of 17 blocks (272 keys, 5 tiles of
        # 64): 1 row -> 2 programs -> 4 splits, 2 rows -> 4 programs -> 1. Full layer: 2
        # counts x (scored, unscored) x (direct, q_rows) = 8; window layer (one 64-key tile
        # -> 1 split, never scored): 2
        assert launches == 10
    assert launches >= 6
    torch.testing.assert_close(cache.kv, before[0], rtol=0, atol=0)
    torch.testing.assert_close(cache.scores, before[1], rtol=0, atol=0)
    torch.testing.assert_close(cache.lens, before[2], rtol=0, atol=0)
