"""Triton paged attention (unified and split-K paths) and the Triton backend against references.

On a machine without CUDA the kernels run through Triton's interpreter (see triton_setup.py) on
small shapes; the big grid (every head size, GQA ratio and block size in bf16 and fp16, longer
contexts) and CUDA-graph capture run only on CUDA.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from tests.kernels.triton_setup import CUDA, DEVICE, cuda_only

# isort: split

import numpy as np

from pagedllm.attention.backends.torch_native import TorchNativeBackend
from pagedllm.attention.backends.triton_backend import TritonBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.ops.paged_attention import paged_attention, paged_attention_ref

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# max |out - ref| <= atol + rtol * |ref|, and ||out - ref|| / ||ref|| <= rel_norm
TOL = {
    torch.bfloat16: (1.5e-2, 1.5e-2, 8e-3),
    torch.float16: (3e-3, 3e-3, 1.5e-3),
    torch.float32: (1e-4, 1e-4, 1e-5),
}
SENTINEL = 7.0  # poisons output rows that must not be written

# (head_dim, gqa ratio, num_kv_heads, block_size)
# head_dim 8: the tiny test models' (padded to 16 for tl.dot on a GPU)
SMALL = [(8, 1, 2, 16), (64, 1, 2, 16), (64, 4, 1, 32), (128, 8, 1, 16), (256, 4, 1, 32)]
BIG = [
    (hd, g, 2, bs)
    for hd, g, bs in itertools.product((64, 128, 256), (1, 4, 8), (16, 32))
    if (hd, g, 2, bs) not in SMALL
]


def _cfg_params() -> list:
    """(dtype, head_dim, gqa, num_kv_heads, block_size): the small configs in every dtype
    (CPU and CUDA); the big grid in bf16 and fp16 on CUDA only (fp32 there would add a third
    of the compile time for no new code path)."""
    params = []
    for dtype in DTYPES:
        for c in SMALL:
            params.append(pytest.param(dtype, *c, id="{}-d{}-g{}-kvh{}-bs{}".format(dtype, *c)))
    for dtype in (torch.bfloat16, torch.float16):
        for c in BIG:
            name = "big-{}-d{}-g{}-kvh{}-bs{}".format(dtype, *c)
            params.append(pytest.param(dtype, *c, id=name, marks=cuda_only))
    return params


CFGS = _cfg_params()


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens (+ padding), H, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D]
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_tables: torch.Tensor  # [R, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    pad_tokens: int = 0,
) -> Batch:
    """A random mixed batch: request r has ctx_lens[r] cached tokens and q_lens[r] new ones
    (already in the cache, as the kernels expect), its blocks scattered over the cache."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    nblk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(q_lens), max(nblk + [1]) + 1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(nblk):
        tables[r, :n] = perm[used : used + n].to(torch.int32)
        used += n
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    n_tok = sum(q_lens)
    query = torch.randn(n_tok + pad_tokens, num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32)
    return Batch(
        query=query.to(DEVICE),
        kv_cache=kv.to(DEVICE),
        query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(DEVICE),
        block_tables=tables.to(DEVICE),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_actual_tokens=n_tok,
    )


def run_kernel(b: Batch, scale: float, window: int | None, num_splits: int | None = None):
    out = torch.full_like(b.query, SENTINEL)
    paged_attention(
        b.query,
        b.kv_cache,
        b.query_start_loc,
        b.seq_lens,
        b.block_tables,
        b.max_query_len,
        b.max_seq_len,
        scale,
        window,
        out=out,
        num_splits=num_splits,
    )
    return out


def check(out: torch.Tensor, b: Batch, scale: float, window: int | None) -> None:
    ref = paged_attention_ref(
        b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, scale, window
    ).cpu()
    n = b.num_actual_tokens
    got = out.float().cpu()
    atol, rtol, rel_norm = TOL[b.query.dtype]
    assert torch.isfinite(got[:n]).all()
    torch.testing.assert_close(got[:n], ref[:n], atol=atol, rtol=rtol)
    assert ((got[:n] - ref[:n]).norm() / ref[:n].norm()).item() <= rel_norm
    assert (got[n:] == SENTINEL).all(), "padding rows past the last request were written"


# Mixed batches: decodes with long and short contexts, prefill chunks after cached context,
# a first chunk with no context, block-boundary-crossing lengths.
MIXED_SMALL = ([1, 7, 1, 20, 3], [9, 130, 70, 0, 31])
MIXED_BIG = ([1, 130, 1, 37, 300, 1, 16], [1000, 200, 4000, 0, 64, 17, 47])


@pytest.mark.parametrize("dtype,head_dim,gqa,num_kv_heads,block_size", CFGS)
def test_unified_mixed_batch(
    dtype: torch.dtype, head_dim: int, gqa: int, num_kv_heads: int, block_size: int
) -> None:
    q_lens, ctx = MIXED_BIG if CUDA else MIXED_SMALL
    b = make_batch(
        q_lens,
        ctx,
        gqa * num_kv_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        seed=1,
        pad_tokens=3,
    )
    scale = head_dim**-0.5
    for window in (None, 8, 100):
        check(run_kernel(b, scale, window, num_splits=1), b, scale, window)


@pytest.mark.parametrize("dtype,head_dim,gqa,num_kv_heads,block_size", CFGS)
def test_short_rows_of_speculative_steps(
    dtype: torch.dtype, head_dim: int, gqa: int, num_kv_heads: int, block_size: int
) -> None:
    """Rows of a token and its drafts (at most 5 here: the small-tile path), fewer near the
    end of a request, an empty padding request and padding tokens, as a verification step's
    CUDA graph lays them out."""
    q_lens, ctx = [5, 5, 2, 1, 0], [40, 3, 70, 17, 1]
    b = make_batch(
        q_lens, ctx, gqa * num_kv_heads, num_kv_heads, head_dim, block_size, dtype, seed=3,
        pad_tokens=12,
    )  # fmt: skip
    scale = head_dim**-0.5
    for window in (None, 8):
        check(run_kernel(b, scale, window), b, scale, window)


@pytest.mark.parametrize("dtype,head_dim,gqa,num_kv_heads,block_size", CFGS)
def test_decode_split_and_unified(
    dtype: torch.dtype, head_dim: int, gqa: int, num_kv_heads: int, block_size: int
) -> None:
    """Decode-only batches through both paths: split-K with several split counts (more splits
    than tiles included) and the unified kernel; a padded request with no tokens included."""
    if CUDA:
        q_lens, ctx = [1, 1, 1, 1, 0], [4500, 1, 700, 63, 0]
        splits = (1, 2, 8, 64)
    else:
        q_lens, ctx = [1, 1, 1, 0], [150, 1, 40, 0]
        splits = (1, 2, 8)
    b = make_batch(
        q_lens,
        ctx,
        gqa * num_kv_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        seed=2,
        pad_tokens=2,
    )
    scale = 0.7 * head_dim**-0.5  # not the default: Gemma-style custom scales must be honoured
    cases = list(itertools.product((None, 50), splits))
    if not CUDA:  # keep the interpreter run short: each split count once, windows alternating
        cases = [(None, 1), (50, 2), (None, 8), (70, 1)]
    for window, s in cases:
        check(run_kernel(b, scale, window, num_splits=s), b, scale, window)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dispatcher_auto(dtype: torch.dtype) -> None:
    """The default dispatch (split-K for a lone long decode, unified otherwise) is right."""
    scale = 64**-0.5
    long_ctx = 6000 if CUDA else 700
    for q_lens, ctx in (([1], [long_ctx]), ([1, 1], [3, 17]), ([4, 1], [10, 600])):
        b = make_batch(q_lens, ctx, 8, 2, 64, 16, dtype, seed=3)
        check(run_kernel(b, scale, None), b, scale, None)


def test_gqa_ratio_not_power_of_two() -> None:
    """Qwen2-7B style GQA 7 and a head size that is not a power of two (80)."""
    b = make_batch([1, 5, 1], [20, 11, 3], 14, 2, 80, 16, torch.float16, seed=4)
    for s in (1, 4):
        if s > 1:  # split-K takes decode-only batches
            b = make_batch([1, 1, 1], [20, 11, 3], 14, 2, 80, 16, torch.float16, seed=4)
        check(run_kernel(b, 80**-0.5, None, num_splits=s), b, 80**-0.5, None)


# ---------------------------------------------------------------------------------------------
# The backend: KV write + attention, against the CPU backend on the same step.
# ---------------------------------------------------------------------------------------------


def _metadata(
    q_lens: list[int], ctx: list[int], tables: np.ndarray, block_size: int, pad: int, dev
) -> AttentionMetadata:
    seq_lens = np.array(ctx) + np.array(q_lens)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    # Example: q_lens [2, 1], ctx [3, 16], block_size 16 -> positions [3, 4, 16]
    #          slots [t0*16 + 3, t0*16 + 4, t1*16 + 0] (t = first/second block of each request)
    pos = np.concatenate([np.arange(c, c + q) for c, q in zip(ctx, q_lens)])
    req = np.repeat(np.arange(len(q_lens)), q_lens)
    slots = tables[req, pos // block_size].astype(np.int64) * block_size + pos % block_size
    slots = np.concatenate([slots, np.full(pad, -1, dtype=np.int64)])
    return AttentionMetadata(
        num_reqs=len(q_lens),
        num_actual_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
        slot_mapping=torch.from_numpy(slots).to(dev),
        block_tables=torch.from_numpy(tables).to(dev),
        max_query_len=int(max(q_lens)),
        max_seq_len=int(seq_lens.max()),
        block_size=block_size,
        query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
    )


# The backend-level tests' batch: decodes, a prefill and a chunk over cached tokens, plus
# CUDA-graph padding rows; (heads, kv_heads, head_dim, block_size, padding tokens).
MIXED_Q, MIXED_CTX, MIXED_SHAPE = [1, 9, 1, 4], [20, 0, 3, 13], (8, 2, 64, 16, 3)


def _mixed_step_against_cpu(backend: object, dtype: torch.dtype, window: int | None) -> tuple:
    """The mixed batch through ``backend`` on DEVICE and through the CPU backend on the CPU:
    (output on DEVICE, the CPU's output, rows that are real tokens); the KV writes compared."""
    q_lens, ctx, (heads, kvh, hd, bs, pad) = MIXED_Q, MIXED_CTX, MIXED_SHAPE
    b = make_batch(q_lens, ctx, heads, kvh, hd, bs, dtype, seed=5, pad_tokens=pad)
    tables = b.block_tables.cpu().numpy()
    gen = torch.Generator().manual_seed(6)
    n = b.query.shape[0]
    key = torch.randn(n, kvh, hd, generator=gen).to(dtype)
    value = torch.randn(n, kvh, hd, generator=gen).to(dtype)
    scale = hd**-0.5

    md_cpu = _metadata(q_lens, ctx, tables, bs, pad, torch.device("cpu"))
    cache_ref = b.kv_cache.cpu().clone()
    ref = TorchNativeBackend().forward(b.query.cpu(), key, value, cache_ref, md_cpu, scale, window)
    md = _metadata(q_lens, ctx, tables, bs, pad, DEVICE)
    cache = b.kv_cache.clone()
    got = backend.forward(  # type: ignore[attr-defined]
        b.query, key.to(DEVICE), value.to(DEVICE), cache, md, scale, window
    )
    assert got.shape == (n, heads * hd)
    assert torch.equal(cache.cpu(), cache_ref), "KV write differs from the reference"
    return got, ref, md.num_actual_tokens


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("window", [None, 6])
def test_triton_backend_matches_torch_native(dtype: torch.dtype, window: int | None) -> None:
    got, ref, m = _mixed_step_against_cpu(TritonBackend(), dtype, window)
    atol, rtol, _ = TOL[dtype]
    torch.testing.assert_close(got[:m].float().cpu(), ref[:m].float(), atol=atol, rtol=rtol)


@cuda_only
@pytest.mark.parametrize("window", [None, 6])
def test_torch_native_backend_on_the_gpu(window: int | None) -> None:
    """The CPU backend's SDPA paths also run on a GPU (the kernels benchmark's reference):
    its plan puts the index tensors on the query's device."""
    got, ref, m = _mixed_step_against_cpu(TorchNativeBackend(), torch.float32, window)
    torch.testing.assert_close(got[:m].cpu(), ref[:m], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_attention_layer_fused_rope_matches_the_torch_path(dtype: torch.dtype) -> None:
    """The attention layer with a rotary embedding and q/k norms: on the Triton backend the
    rotation is the kernel that writes K/V (``rope_and_cache``), on the CPU backend PyTorch
    ops and a separate write; same cache, same output (padding rows' slots -1 untouched)."""
    from pagedllm.model.layers.attention import Attention
    from pagedllm.model.layers.norm import RMSNorm
    from pagedllm.model.layers.rotary import RotaryEmbedding

    q_lens, ctx, (heads, kvh, hd, bs, pad) = MIXED_Q, MIXED_CTX, MIXED_SHAPE
    b = make_batch(q_lens, ctx, heads, kvh, hd, bs, dtype, seed=8, pad_tokens=pad)
    tables = b.block_tables.cpu().numpy()
    gen = torch.Generator().manual_seed(9)
    n = b.query.shape[0]
    q = b.query.cpu().reshape(n, heads * hd)
    k = torch.randn(n, kvh * hd, generator=gen).to(dtype)
    v = torch.randn(n, kvh * hd, generator=gen).to(dtype)
    positions = torch.tensor(
        [c + i for c, ql in zip(ctx, q_lens) for i in range(ql)] + [0] * pad, dtype=torch.int64
    )
    rotary = RotaryEmbedding(hd, 256, 1e6)
    norms = [RMSNorm(hd, 1e-6, dtype) for _ in "qk"]
    for m in norms:
        m.weight.data.copy_((torch.randn(hd, generator=gen) * 0.3 + 1).to(dtype))

    def run(backend, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        layer = Attention(heads, kvh, hd, hd**-0.5)
        layer.backend = backend
        layer.kv_cache = b.kv_cache.to(dev).clone()
        md = _metadata(q_lens, ctx, tables, bs, pad, dev)
        out = layer(
            q.to(dev), k.to(dev), v.to(dev), md, positions.to(dev), rotary.to(dev),
            *[m.to(dev) for m in norms],
        )  # fmt: skip
        return out[: md.num_actual_tokens].float().cpu(), layer.kv_cache.cpu()

    ref_out, ref_cache = run(TorchNativeBackend(), torch.device("cpu"))
    got_out, got_cache = run(TritonBackend(), DEVICE)
    atol, rtol, _ = TOL[dtype]
    atol *= 4  # three roundings (norm, weight, rotation), each an ulp off in the interpreter
    torch.testing.assert_close(got_cache.float(), ref_cache.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(got_out, ref_out, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------
# CUDA graphs: capture a decode step once, grow the sequences, replay.
# ---------------------------------------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("num_splits", [1, 8])
def test_cuda_graph_capture_and_replay(num_splits: int) -> None:
    q_lens, ctx = [1, 1, 1, 0], [300, 40, 1000, 0]  # the last request is graph padding
    b = make_batch(q_lens, ctx, 32, 8, 128, 16, torch.bfloat16, seed=7, pad_tokens=4)
    scale = 128**-0.5
    out = torch.full_like(b.query, SENTINEL)

    def step() -> None:
        paged_attention(
            b.query,
            b.kv_cache,
            b.query_start_loc,
            b.seq_lens,
            b.block_tables,
            1,
            4096,
            scale,
            None,
            out=out,
            num_splits=num_splits,
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for grow in (0, 5, 17):  # sequences grow in place (blocks 0..max already in the table)
        new_lens = torch.tensor([c + 1 + grow for c in ctx[:3]] + [0], dtype=torch.int32)
        b.seq_lens.copy_(new_lens.to(DEVICE))
        b.query.normal_()
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        b.max_seq_len = int(new_lens.max())
        check(out, b, scale, None)


@cuda_only
def test_cuda_graph_of_speculative_rows() -> None:
    """A graph captured for 4 requests of 5-token rows replays a step of 3 requests with 5, 3
    and 1 tokens (the 4th a padding request: no rows) after the contexts grew."""
    q_lens, ctx = [5, 5, 5, 5], [300, 40, 1000, 60]
    b = make_batch(q_lens, ctx, 32, 8, 128, 16, torch.bfloat16, seed=9)
    scale = 128**-0.5
    out = torch.full_like(b.query, SENTINEL)

    def step() -> None:
        paged_attention(
            b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, 5, 4096, scale,
            None, out=out,
        )  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_q = [5, 3, 1, 0]
    new_lens = [300 + 7, 40 + 3, 1000 + 1, 1]
    qsl = [0, 5, 8, 9, 9]
    b.query_start_loc.copy_(torch.tensor(qsl, dtype=torch.int32))
    b.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    b.query.normal_()
    out.fill_(SENTINEL)
    graph.replay()
    torch.cuda.synchronize()
    b.max_query_len, b.max_seq_len, b.num_actual_tokens = max(new_q), max(new_lens), 9
    ref = paged_attention_ref(
        b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, scale
    ).cpu()
    atol, rtol, _ = TOL[torch.bfloat16]
    torch.testing.assert_close(out[:9].float().cpu(), ref[:9], atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_long_chunks_take_the_long_tiles(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype):
    """A batch with a chunk of ``LONG_CHUNK`` tokens or more runs ``LONG_CHUNK_TILES`` (256
    rows over 8 warps, on Hopper, 16-bit K/V; float32 keeps the default) in both prefill
    kernels - the unified paged one, decode rows beside the chunk, and KV-Compress's per-head
    one - and both still match the reference.
    The device check is patched (any GPU, the interpreter); off a GPU the threshold is too,
    so that the interpreter runs that launch shape on a short chunk."""
    import pagedllm.ops.kvc_attention.prefill as kvc
    import pagedllm.ops.paged_attention as pa

    monkeypatch.setattr(pa, "_is_hopper", lambda device: True)
    if not CUDA:
        monkeypatch.setattr(pa, "LONG_CHUNK", 24)
    chosen = []

    def spy(*args, **kwargs):
        chosen.append(pa.default_tile_config(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(kvc, "default_tile_config", spy)
    long_len = 2100 if CUDA else 30
    q_lens, ctx = [1, long_len, 1, 5], [300, 100, 900 if CUDA else 40, 0]
    num_heads, num_kv_heads, head_dim, bs = 8, 2, 128 if CUDA else 64, 16
    b = make_batch(q_lens, ctx, num_heads, num_kv_heads, head_dim, bs, dtype, seed=5)
    dev, size = b.query.device, dtype.itemsize
    # float32 K/V keep the default (the long tiles' stages overflow shared memory in float32)
    long = pa.default_tile_config(head_dim, False, pa.LONG_CHUNK, dev, size)
    assert (long is pa.LONG_CHUNK_TILES) == (size == 2)
    assert pa.default_tile_config(head_dim, False, pa.LONG_CHUNK - 1, dev, size).block_m == 64
    scale = head_dim**-0.5
    check(run_kernel(b, scale, None, num_splits=1), b, scale, None)
    # the same chunks through the per-head kernel: every KV head reads the request's blocks
    # through its own table row ([R, H, W] tables, [R, H] lengths)
    kv = b.kv_cache  # [2, blocks, bs, H, D] -> per-head blocks [2, blocks * H, bs, D]
    nb = kv.shape[1]
    per_head = kv.permute(0, 1, 3, 2, 4).reshape(2, nb * num_kv_heads, bs, head_dim)
    heads = torch.arange(num_kv_heads, dtype=torch.int32, device=kv.device)
    tables = (b.block_tables[:, None, :] * num_kv_heads + heads[None, :, None]).contiguous()
    lens = b.seq_lens[:, None].expand(-1, num_kv_heads).contiguous()
    out = kvc.kvc_paged_attention(
        b.query, per_head, b.query_start_loc, lens, tables, b.max_query_len, scale
    )
    assert chosen == [long]
    ref = paged_attention_ref(
        b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, scale, None
    ).cpu()
    atol, rtol, _ = TOL[dtype]
    torch.testing.assert_close(out.float().cpu(), ref, atol=atol, rtol=rtol)


def test_start_up_lengths_cover_every_prefill_tile_shape(monkeypatch: pytest.MonkeyPatch):
    """``prefill_variant_query_lens`` gives one longest-row length per tile shape of the
    unified kernel (a compile each) that a step with prompt tokens can pick, and every
    length up to the limit picks one of those shapes: a runner that runs them at start-up
    meets no compile later."""
    import pagedllm.ops.paged_attention as pa

    monkeypatch.setattr(pa, "_is_hopper", lambda device: True)
    dev = torch.device("cpu")
    for head_dim, g, size in [(128, 2, 2), (128, 4, 1), (256, 8, 2), (64, 1, 4), (128, 6, 2)]:
        pad = max(16, 1 << (head_dim - 1).bit_length())

        def shape(q: int, pad: int = pad, g: int = g, size: int = size) -> tuple:
            cfg = pa.default_tile_config(pad, False, q, dev, size)
            return pa.unified_block_m(cfg, g, q), cfg

        lens = pa.prefill_variant_query_lens(head_dim, g, dev, size, 4096)
        assert len({shape(q) for q in lens}) == len(lens)
        assert {shape(q) for q in range(2, 4097)} == {shape(q) for q in lens}
        short = pa.prefill_variant_query_lens(head_dim, g, dev, size, 12)
        assert short == [q for q in lens if q <= 12]
    # the docstring's example: 16, 32, 64 and 256-row tiles
    assert pa.prefill_variant_query_lens(128, 2, dev, 2, 4096) == [2, 9, 17, pa.LONG_CHUNK]
