"""The Triton fused ops of the decoder layer against their PyTorch layers (the CPU path and
reference): add + RMSNorm, SiLU/GELU-and-mul, and q/k-norm + rotary embedding.

On a machine without CUDA the kernels run through Triton's interpreter on small shapes.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import CUDA, DEVICE

# isort: split

from pagedllm.attention.backends.torch_native import write_kv_cache as write_kv_cache_ref
from pagedllm.model.layers.activation import GeluAndMul, SiluAndMul
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.ops.activation import act_and_mul
from pagedllm.ops.rms_norm import fused_add_rms_norm
from pagedllm.ops.rotary import rope, rope_and_cache

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy, interpreter

TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-5}


def _close(
    got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, exact: float, atol: float = 0.0
) -> None:
    """Within a few units in the last place; and, where the interpreter and the GPU round the
    same way (float16 everywhere, bfloat16 on CUDA: the interpreter truncates float32 ->
    bfloat16), at least ``exact`` of the values bit-identical (same roundings in the same
    places; only float32 sums in another order or an exp of another library may differ)."""
    assert got.shape == ref.shape and got.dtype == dtype
    atol = max(atol, TOL[dtype])
    torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=TOL[dtype], atol=atol)
    if dtype == torch.float16 or (dtype == torch.bfloat16 and CUDA):
        same = (got.cpu() == ref).float().mean().item()
        assert same >= exact, f"only {same:.3f} of the values are bit-identical"


def _norm(n: int, dtype: torch.dtype, offset: float, gen: torch.Generator) -> RMSNorm:
    layer = RMSNorm(n, 1e-6, dtype, offset)
    layer.weight.data.copy_((torch.randn(n, generator=gen) * 0.5 + (0 if offset else 1)).to(dtype))
    return layer


# --- add + RMSNorm -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n", [64, 96, 1024] if not CUDA else [64, 96, 1024, 4096, 5120])
@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
def test_add_rms_norm_equals_add_then_norm(dtype: torch.dtype, n: int, offset: float) -> None:
    gen = torch.Generator().manual_seed(n)
    layer = _norm(n, dtype, offset, gen)
    x = (torch.randn(11, n, generator=gen) * 3).to(dtype)
    r = (torch.randn(11, n, generator=gen) * 3).to(dtype)
    ref_s = x + r
    ref_y = layer(ref_s)
    y, s = fused_add_rms_norm(x.to(DEVICE), r.to(DEVICE), layer.weight.to(DEVICE), 1e-6, offset)
    # the sum is one rounded add: bit-identical wherever both round the same way
    _close(s, ref_s, dtype, exact=1.0)
    _close(y, ref_y, dtype, exact=0.97)
    # the layer's residual form gives the same pair on the CPU (its reference path)
    cy, cs = layer(x, r)
    assert torch.equal(cy, ref_y) and torch.equal(cs, ref_s)


def test_add_rms_norm_reads_strided_rows_and_rejects_mismatches() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = _norm(64, torch.float32, 0.0, gen)
    wide = torch.randn(5, 128, generator=gen)
    x, r = wide[:, :64], wide[:, 64:]  # row stride 128
    y, s = fused_add_rms_norm(x.to(DEVICE), r.to(DEVICE), layer.weight.to(DEVICE), 1e-6)
    _close(y, layer(x + r), torch.float32, exact=0.0)
    with pytest.raises(ValueError, match="one shape and dtype"):
        fused_add_rms_norm(x, r[:4], layer.weight, 1e-6)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused_add_rms_norm(wide[:, ::2], wide[:, 1::2], layer.weight, 1e-6)
    empty = torch.empty(0, 64, device=DEVICE)
    assert fused_add_rms_norm(empty, empty, layer.weight.to(DEVICE), 1e-6)[0].shape == (0, 64)


# --- act(gate) * up --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("inter", [32, 200, 1536] if not CUDA else [32, 200, 1536, 3072, 14336])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_and_mul_equals_the_layer(dtype: torch.dtype, inter: int, act: str) -> None:
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(7, 2 * inter, generator=gen) * 4).to(dtype)
    ref = (SiluAndMul() if act == "silu" else GeluAndMul())(x)
    got = act_and_mul(x.to(DEVICE), act)
    # exp in another library may move the float32 activation by an ulp before its rounding;
    # GELU's tanh written through exp also differs where PyTorch's 1 + tanh(u) cancels to 0
    # for very negative inputs (-0.0 there, -1e-14 here): fewer bit-identical values
    _close(got, ref, dtype, exact=0.97 if act == "silu" else 0.8)


def test_act_and_mul_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="activation must be one of"):
        act_and_mul(torch.randn(2, 8, device=DEVICE), "relu")
    with pytest.raises(ValueError, match="even, contiguous last dim"):
        act_and_mul(torch.randn(2, 7, device=DEVICE), "silu")
    assert act_and_mul(torch.randn(0, 8, device=DEVICE), "silu").shape == (0, 4)


# --- (q/k norm +) rotary embedding --------------------------------------------------------------


def _qkv(tokens: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype, gen):  # noqa: ANN202
    """q, k views into one fused qkv row per token, as the attention layer makes them."""
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 2).to(dtype)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
    return q, k


CASES = [(64, 4, 1), (128, 8, 2), (256, 4, 4)]
if CUDA:
    CASES += [(128, 16, 8), (128, 32, 8), (96, 12, 4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("d,heads,kv_heads", CASES)
@pytest.mark.parametrize("norm", ["none", "qwen3", "gemma3"])
def test_rope_equals_the_layer(dtype, d: int, heads: int, kv_heads: int, norm: str) -> None:
    gen = torch.Generator().manual_seed(d * heads + kv_heads)
    rotary = RotaryEmbedding(d, 4096, 10000.0)
    q, k = _qkv(9, heads, kv_heads, d, dtype, gen)
    positions = torch.randint(0, 4096, (9,), generator=gen)
    norms = (None, None)
    if norm != "none":
        offset = 1.0 if norm == "gemma3" else 0.0
        norms = (_norm(d, dtype, offset, gen), _norm(d, dtype, offset, gen))
    ref_q, ref_k = rotary(positions, q, k, *norms)  # CPU tensors: the PyTorch path
    w = [None if m is None else m.weight.to(DEVICE) for m in norms]
    got_q, got_k = rope(
        positions.to(DEVICE),
        q.to(DEVICE),
        k.to(DEVICE),
        rotary.cos_sin.to(DEVICE),
        *w,
        eps=1e-6,
        offset=1.0 if norm == "gemma3" else 0.0,
    )
    assert got_q.is_contiguous() and got_k.is_contiguous()
    # A fused multiply-add in the rotation may move a float32 value by an ulp before rounding;
    # a normed input off by an ulp (the interpreter's truncation) is off by an ulp of the
    # input's size, not of the output's, where x1 cos - x2 sin cancels: an absolute bound.
    atol = 4 * TOL[dtype]
    _close(got_q, ref_q, dtype, exact=0.97, atol=atol)
    _close(got_k, ref_k, dtype, exact=0.97, atol=atol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("d,heads,kv_heads", CASES)
@pytest.mark.parametrize("norm", ["none", "qwen3", "gemma3"])
def test_rope_and_cache_equals_rope_then_kv_write(dtype, d, heads, kv_heads, norm) -> None:
    """The fused kernel's q is rope's, and its cache is rope's K and the V written at the
    slots, -1 (CUDA-graph padding) and tokens past the slot list skipped, the rest untouched."""
    gen = torch.Generator().manual_seed(7 * d + heads)
    rotary = RotaryEmbedding(d, 4096, 10000.0)
    tokens, block_size, num_blocks = 9, 4, 6
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen) * 2).to(dtype)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:7]
    slots[2] = -1  # a padding row; tokens 7 and 8 have no slot at all
    cache = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    norms = (None, None)
    offset = 1.0 if norm == "gemma3" else 0.0
    if norm != "none":
        norms = (_norm(d, dtype, offset, gen), _norm(d, dtype, offset, gen))
    ref_q, ref_k = rotary(positions, q, k, *norms)  # the PyTorch path
    ref_cache = cache.clone()
    write_kv_cache_ref(ref_k, v, ref_cache, slots)
    w = [None if m is None else m.weight.to(DEVICE) for m in norms]
    got_cache = cache.to(DEVICE)
    got_q = rope_and_cache(
        positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
        rotary.cos_sin.to(DEVICE), got_cache, slots.to(DEVICE), *w, eps=1e-6, offset=offset,
    )  # fmt: skip
    atol = 4 * TOL[dtype]
    _close(got_q, ref_q, dtype, exact=0.97, atol=atol)
    _close(got_cache, ref_cache, dtype, exact=0.97, atol=atol)
    written = slots[slots >= 0]
    flat = got_cache.cpu().view(2, -1, kv_heads, d)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[:, untouched], cache.view(2, -1, kv_heads, d)[:, untouched])
    assert torch.equal(flat[1, written], v[: len(slots)][slots >= 0])  # V copied bit for bit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("norm", ["none", "qwen3"])
def test_rope_and_cache_per_head_slots(dtype, norm) -> None:
    """KV-Compress's one-head blocks: every (token, KV head) goes to its own slot of the
    [2, num_blocks, block_size, d] cache, from a strided [T, H] view of the [T, L*H] slot list
    (one layer's heads), exactly as rope then ``write_head_kv``; slot -1 and tokens past the
    list are skipped, every other slot untouched."""
    from pagedllm.kvcompress.attention import write_head_kv

    gen = torch.Generator().manual_seed(11)
    d, heads, kv_heads, layers = 64, 8, 4, 3
    rotary = RotaryEmbedding(d, 4096, 10000.0)
    tokens, block_size, num_blocks = 9, 4, 40
    q = (torch.randn(tokens, heads, d, generator=gen) * 2).to(dtype)
    k = (torch.randn(tokens, kv_heads, d, generator=gen) * 2).to(dtype)
    v = torch.randn(tokens, kv_heads, d, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    all_slots = torch.randperm(num_blocks * block_size, generator=gen)[: 7 * layers * kv_heads]
    all_slots = all_slots.view(7, layers * kv_heads)  # [T', L*H]
    slots = all_slots[:, kv_heads : 2 * kv_heads]  # layer 1's heads: a strided view
    slots[2, 1] = -1  # padding: skipped; tokens 7, 8 have no slots
    cache = torch.randn(2, num_blocks, block_size, d, generator=gen).to(dtype)
    norms = (None, None)
    if norm != "none":
        norms = (_norm(d, dtype, 0.0, gen), _norm(d, dtype, 0.0, gen))
    ref_q, ref_k = rotary(positions, q, k, *norms)
    ref_cache = cache.clone()
    keep = slots >= 0
    flat_ref = ref_cache.view(2, -1, d)
    flat_ref[0, slots[keep]] = ref_k[:7][keep]
    flat_ref[1, slots[keep]] = v[:7][keep]
    w = [None if m is None else m.weight.to(DEVICE) for m in norms]
    got_cache = cache.to(DEVICE)
    got_q = rope_and_cache(
        positions.to(DEVICE), q.to(DEVICE), k.to(DEVICE), v.to(DEVICE),
        rotary.cos_sin.to(DEVICE), got_cache, slots.to(DEVICE), *w, eps=1e-6,
    )  # fmt: skip
    atol = 4 * TOL[dtype]
    _close(got_q, ref_q, dtype, exact=0.97, atol=atol)
    _close(got_cache, ref_cache, dtype, exact=0.97, atol=atol)
    assert torch.equal(got_cache.cpu().view(2, -1, d)[1], flat_ref[1])  # V bit for bit
    if dtype == torch.float32 and norm == "none":  # the unfused path writes the same
        again = cache.clone()
        spare = min(set(range(num_blocks * block_size)) - set(all_slots.flatten().tolist()))
        fill = torch.where(keep, slots, spare)  # write_head_kv has no -1
        write_head_kv(ref_k[:7], v[:7], again[0].view(-1, d), again[1].view(-1, d), fill)
        assert torch.equal(again.view(2, -1, d)[:, slots[keep]], flat_ref[:, slots[keep]])


def test_rope_rejects_bad_input() -> None:
    cs = RotaryEmbedding(64, 16, 10000.0).cos_sin.to(DEVICE)
    q = torch.randn(3, 2, 64, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="do not match"):
        rope(pos, q, torch.randn(2, 1, 64, device=DEVICE), cs)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rope(pos, q[..., ::2], q[..., ::2], cs)
    with pytest.raises(ValueError, match="both q and k norm weights"):
        rope(pos, q, q, cs, torch.ones(64, device=DEVICE))


@pytest.mark.skipif(not CUDA, reason="the layers dispatch to Triton only for CUDA tensors")
def test_layers_dispatch_to_the_kernels_on_cuda() -> None:
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    norm = _norm(1024, dtype, 0.0, gen)
    x = torch.randn(5, 1024, generator=gen).to(dtype)
    r = torch.randn(5, 1024, generator=gen).to(dtype)
    ref_y, ref_s = norm(x, r)
    y, s = norm.to(DEVICE)(x.to(DEVICE), r.to(DEVICE))
    _close(s, ref_s, dtype, 1.0)
    _close(y, ref_y, dtype, 0.97)
    g = torch.randn(5, 512, generator=gen).to(dtype)
    _close(SiluAndMul()(g.to(DEVICE)), SiluAndMul()(g), dtype, 0.97)
    rotary = RotaryEmbedding(128, 256, 1e6)
    q, k = _qkv(5, 4, 2, 128, dtype, gen)
    pos = torch.arange(5)
    qn, kn = _norm(128, dtype, 0.0, gen), _norm(128, dtype, 0.0, gen)
    ref_q, ref_k = rotary(pos, q, k, qn, kn)
    got_q, got_k = rotary.to(DEVICE)(
        pos.to(DEVICE), q.to(DEVICE), k.to(DEVICE), qn.to(DEVICE), kn.to(DEVICE)
    )
    _close(got_q, ref_q, dtype, 0.97)
    _close(got_k, ref_k, dtype, 0.97)
