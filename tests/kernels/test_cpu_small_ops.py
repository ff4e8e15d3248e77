"""The compiled bfloat16 RMSNorm and rotary embedding of the CPU path (``pagedllm.ops.cpu``)
against the PyTorch code they replace (the layers with the kernels off): the rotation bit for
bit, the norm within one bfloat16 rounding (its sum of squares is added in another order);
and in float32 the norm and silu-and-mul within ulps of PyTorch's (``PAGEDLLM_FLOAT32_EXACT=1``
keeps float32 on PyTorch's ops)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import get_rope
from pagedllm.ops import cpu as cpu_ops
from tests.kernels.test_cpu_paged_decode import _ext


def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("shape", [(1, 64), (37, 576), (5, 9, 64)])
def test_rms_norm_matches_layer(monkeypatch: pytest.MonkeyPatch, offset: float, shape) -> None:  # noqa: ANN001
    _ext()
    g = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    norm = RMSNorm(shape[-1], 1e-6, torch.bfloat16, offset=offset)
    norm.weight.data = torch.randn(shape[-1], generator=g).to(torch.bfloat16)
    x = (3 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    r = torch.randn(shape, generator=g).to(torch.bfloat16)
    got, (got_y, got_s) = norm(x), norm(x, r)
    assert cpu_ops.rms_norm(x, norm.weight, 1e-6, offset) is not None  # the kernel ran
    _torch_path(monkeypatch)
    want, (want_y, want_s) = norm(x), norm(x, r)
    assert torch.equal(got_s, want_s)  # the residual sum: one rounding, the same
    for a, b in ((got, want), (got_y, want_y)):
        assert a.shape == b.shape and a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=0, rtol=2**-7)  # <= 1 ulp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_layer_bit_for_bit(monkeypatch: pytest.MonkeyPatch, dtype) -> None:  # noqa: ANN001
    _ext()
    g = torch.Generator().manual_seed(3)
    rope = get_rope(64, 4096, 10000.0)
    qkv = torch.randn(29, 15 * 64, generator=g).to(dtype)
    q, k = qkv[:, : 9 * 64].view(29, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(29, 3, 64)  # views
    pos = torch.randint(0, 4096, (29,), generator=g)
    got = rope(pos, q, k)
    assert cpu_ops.rope(q, pos, rope.cos_sin) is not None
    with pytest.raises(RuntimeError, match="position out of range"):
        cpu_ops.rope(q, torch.full((29,), 4096), rope.cos_sin)
    _torch_path(monkeypatch)
    want = rope(pos, q, k)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_float32_norm_and_silu_within_ulps_and_exact_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """float32: the compiled norm (sum of squares in another order) and silu-and-mul (a
    polynomial exponential) are within a couple of ulps of the layers' PyTorch code; with
    ``PAGEDLLM_FLOAT32_EXACT=1`` the layers run that code (bit for bit HF's) and rope, exact in
    float32, stays compiled; float16 takes none of the kernels. The norm runs compiled on
    every CPU; the silu only where it vectorizes (AVX-512), else PyTorch's."""
    from pagedllm.model.layers.activation import SiluAndMul

    ops = _ext()
    vectorized = ops.small_ops_vectorized()
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(37, 576, generator=g), torch.randn(37, 576, generator=g)
    gu = 4 * torch.randn(37, 2 * 1536, generator=g)
    norm = RMSNorm(576, 1e-6, torch.float32)
    norm.weight.data = torch.randn(576, generator=g)
    monkeypatch.delenv("PAGEDLLM_FLOAT32_EXACT", raising=False)
    assert cpu_ops.rms_norm(x, norm.weight, 1e-6, 0.0) is not None  # the kernel runs
    assert (cpu_ops.silu_and_mul(gu) is not None) == vectorized
    got = (norm(x), *norm(x, r), SiluAndMul()(gu))
    monkeypatch.setenv("PAGEDLLM_FLOAT32_EXACT", "1")
    assert cpu_ops.rms_norm(x, norm.weight, 1e-6, 0.0) is None
    assert cpu_ops.silu_and_mul(gu) is None
    want = (norm(x), *norm(x, r), SiluAndMul()(gu))
    assert torch.equal(got[2], want[2])  # the residual sum: one rounding, the same
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=4e-7)
    assert cpu_ops.rope(
        x.view(37, 9, 64), torch.zeros(37, dtype=torch.long), torch.ones(8, 64)
    ).shape == (37, 9, 64)
    assert cpu_ops.rope(x.half().view(37, 9, 64), torch.zeros(37), torch.ones(8, 64)) is None
    assert cpu_ops.rms_norm(x.half(), norm.weight.half(), 1e-6, 0.0) is None


def test_packed_linear_and_lm_head_equal_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 layers packed for oneDNN (``pack_for_cpu``, done by the model loader on a CPU)
    give F.linear's outputs bit for bit (float32 ones within rounding), for decode rows, a
    prefill chunk and 3-D input; the plain weight of a linear layer is freed, the LM head
    keeps its (tied) one."""
    from torch.nn import functional as F

    from pagedllm.model.layers.embedding import LMHead
    from pagedllm.model.layers.linear import ReplicatedLinear

    monkeypatch.setenv("PAGEDLLM_BF16_CARRIER", "0")  # (the float32 carrier: the next test)
    if cpu_ops_pack_unavailable():
        pytest.skip("this torch has no oneDNN bfloat16 matmul")
    g = torch.Generator().manual_seed(5)
    for layer, w, b in _random_bf16_layers(g):
        assert layer.pack_for_cpu()
        assert layer.weight.numel() == 0  # the plain copy is gone
        for shape in [(1, 64), (7, 64), (300, 64), (2, 5, 64)]:
            x = torch.randn(shape, generator=g).to(torch.bfloat16)
            assert torch.equal(layer(x), F.linear(x, w, b))
    head = LMHead(1000, 64, torch.bfloat16)
    head.weight.data = torch.randn(1000, 64, generator=g).to(torch.bfloat16)
    h = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    want, want_ids = head(h), head.argmax(h)
    assert head.pack_for_cpu() and head.weight.numel() == 1000 * 64
    assert torch.equal(head(h), want) and torch.equal(head.argmax(h), want_ids)
    # float32 packs too: F.linear's results within float32 rounding (another order of sums)
    layer = ReplicatedLinear(64, 96, True, torch.float32)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=g)
    w, b = layer.weight.data.clone(), layer.bias
    assert layer.pack_for_cpu() and layer.weight.numel() == 0
    for shape in [(1, 64), (300, 64), (2, 5, 64)]:
        x = torch.randn(shape, generator=g)
        torch.testing.assert_close(layer(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    # PAGEDLLM_FLOAT32_EXACT keeps float32 on F.linear; the switch keeps both plain
    monkeypatch.setenv("PAGEDLLM_FLOAT32_EXACT", "1")
    assert not ReplicatedLinear(8, 8, False, torch.float32).pack_for_cpu()
    assert ReplicatedLinear(8, 8, False, torch.bfloat16).pack_for_cpu()
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", "0")
    assert not ReplicatedLinear(8, 8, False, torch.bfloat16).pack_for_cpu()
    assert not ReplicatedLinear(8, 8, False, torch.float32).pack_for_cpu()


def _random_bf16_layers(g: torch.Generator) -> list:
    """A bfloat16 linear layer with a bias and a fused QKV one, random weights: (layer, its
    weight, its bias) each, the weight cloned before packing frees it."""
    from pagedllm.model.layers.linear import QKVParallelLinear, ReplicatedLinear

    out = []
    for layer in (ReplicatedLinear(64, 96, True, torch.bfloat16),
                  QKVParallelLinear(64, 16, 4, 2, False, torch.bfloat16)):  # fmt: skip
        for p in layer.parameters():
            p.data = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        out.append((layer, layer.weight.data.clone(), layer.bias))
    return out


def cpu_ops_pack_unavailable() -> bool:
    return cpu_ops.pack_linear(torch.zeros(4, 4, dtype=torch.bfloat16)) is None


def test_bfloat16_matmuls_on_a_float32_carrier(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without bfloat16 instructions (forced here), bfloat16 linear layers and the LM
    head multiply on float32 copies of their weights: the outputs are bfloat16, each the
    exact product rounded once (within half an ulp of a float64 reference, plus float32's
    summation error), ties broken as a bfloat16 matmul's would be up to the sums' order;
    PAGEDLLM_BF16_CARRIER=0 turns it off."""
    from pagedllm import config as config_mod
    from pagedllm.model.layers.embedding import LMHead
    from pagedllm.model.layers.linear import ReplicatedLinear

    monkeypatch.setattr(config_mod, "cpu_has_bf16", lambda: False)
    if cpu_ops.pack_linear(torch.zeros(4, 4)) is None:
        pytest.skip("this torch has no oneDNN matmul")
    g = torch.Generator().manual_seed(7)

    def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None):
        assert y.dtype == torch.bfloat16
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        mag = torch.nn.functional.linear(x.double().abs(), w.double().abs())  # sum of |terms|
        err = (y.double() - ref).abs()
        assert (err <= ref.abs() * 2.0**-8 + mag * 2.0**-20).all(), err.max()

    for layer, w, b in _random_bf16_layers(g):
        assert layer.pack_for_cpu() and layer._packed.dtype == torch.float32
        for shape in [(1, 64), (300, 64), (2, 5, 64)]:
            x = torch.randn(shape, generator=g).to(torch.bfloat16)
            check(layer(x), x, w, b)
    head = LMHead(1000, 64, torch.bfloat16)
    head.weight.data = torch.randn(1000, 64, generator=g).to(torch.bfloat16)
    h = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    assert head.pack_for_cpu()
    check(head._logits(h), h, head.weight.data, None)
    monkeypatch.setenv("PAGEDLLM_BF16_CARRIER", "0")
    layer = ReplicatedLinear(8, 8, False, torch.bfloat16)
    assert not layer.pack_for_cpu() or layer._packed.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(1, 2 * 576), (64, 2 * 1536), (3, 5, 2 * 40), (2, 2 * 7)])
def test_silu_and_mul_matches_layer(monkeypatch: pytest.MonkeyPatch, shape) -> None:  # noqa: ANN001
    """The compiled bfloat16 silu-and-mul against the layer's PyTorch code: values spread
    over float32's range (silu of large negative gates is -0 in torch), widths that are not a
    multiple of 16 (the scalar tail); equal but for rare roundings of a float32 silu that
    lies within the polynomial exponential's error of a bfloat16 boundary."""
    from pagedllm.model.layers.activation import SiluAndMul

    _ext()
    g = torch.Generator().manual_seed(shape[-1])
    x = (4 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    x.view(-1)[:6] = torch.tensor([-200.0, 200.0, 0.0, -0.0, 88.5, -88.5]).to(torch.bfloat16)
    layer = SiluAndMul()
    got = layer(x)
    assert cpu_ops.silu_and_mul(x) is not None  # the kernel ran
    _torch_path(monkeypatch)
    want = layer(x)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert (got != want).float().mean().item() <= 1e-3
    torch.testing.assert_close(got.float(), want.float(), atol=1e-30, rtol=2**-7)  # <= 1 ulp


def test_silu_and_mul_many_values_rarely_round_apart() -> None:
    """3M random gates: the fused kernel's bfloat16 results equal torch's in all but a
    handful of places (none on this project's Xeon)."""
    import torch.nn.functional as F

    _ext()
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2048, 2 * 1536, generator=g)).to(torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    assert int((cpu_ops.silu_and_mul(x) != F.silu(gate) * up).sum()) <= 30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype: torch.dtype) -> None:
    """The compiled KV write: the reference's cache bit for bit, keys and values as strided
    views of a QKV projection, slot -1 skipped, fewer slots than tokens (padding rows); a
    slot past the cache is an error, not a write out of bounds; a dtype other than the
    cache's goes to the reference."""
    from pagedllm.kv_layout import write_kv_ref

    _ext()
    g = torch.Generator().manual_seed(1)
    kv = torch.zeros(2, 20, 16, 3, 64, dtype=dtype)
    qkv = torch.randn(40, 15 * 64, generator=g).to(dtype)
    k, v = qkv[:, 9 * 64 : 12 * 64].view(40, 3, 64), qkv[:, 12 * 64 :].view(40, 3, 64)
    slots = torch.randperm(320, generator=g)[:37]
    slots[[3, 20]] = -1
    want = kv.clone()
    write_kv_ref(k, v, want, slots)
    got = kv.clone()
    assert cpu_ops.write_kv(k, v, got, slots)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_ops.write_kv(k, v, got, torch.tensor([320]))
    assert not cpu_ops.write_kv(k.to(torch.float16), v.to(torch.float16), got, slots)
