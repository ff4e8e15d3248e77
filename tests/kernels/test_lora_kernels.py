"""The LoRA Triton kernels (``pagedllm/ops/lora.py``) against the PyTorch reference
(``pagedllm/lora/ops.py``): ragged groups of tokens per adapter slot with base-model tokens
(slot -1) between them, adapter ranks 8 and 16 in slots of rank 16 (zero past the rank),
fused layers of 1 to 3 sub-projections, float32 and bfloat16. On a machine without CUDA the
kernels run through Triton's interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.triton_setup import DEVICE

# isort: split

from pagedllm.lora.batch import segments
from pagedllm.lora.ops import lora_expand_ref, lora_shrink_ref
from pagedllm.ops.lora import lora_expand, lora_shrink

L, R, MAX_TOKENS = 3, 16, 64


def _case(rank: int, subs: list[int], dtype: torch.dtype, seed: int, K: int = 48):  # noqa: ANN202
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    T, N = 37, sum(subs)
    # ragged runs of slots (a request's tokens are contiguous), -1 runs between them
    slots = np.repeat(rng.integers(-1, L, 9), rng.integers(1, 8, 9))[:T]
    T = len(slots)
    x = torch.randn(T, K, generator=gen).to(dtype)
    a = torch.zeros(L, len(subs) * R, K)
    b = torch.zeros(L, N, R)
    for k in range(len(subs)):
        a[:, k * R : k * R + rank] = torch.randn(L, rank, K, generator=gen) * 0.3
    b[:, :, :rank] = torch.randn(L, N, rank, generator=gen) * 0.3
    out = torch.randn(T, N, generator=gen).to(dtype)
    return slots, x, a.to(dtype), b.to(dtype), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rank,subs,K,tiles",
    [(8, [32, 16, 16], 48, {}), (16, [40], 48, {}), (16, [24, 24], 48, {}),
     # split-K: 4 stretches of K (partial sums added atomically), and one ragged stretch
     (16, [32, 16, 16], 300, {"split_k": 4}), (8, [40], 300, {"split_k": 3, "block_m": 64})],
    ids=["qkv", "one", "gate_up", "qkv-split4", "split3-wide"],
)  # fmt: skip
def test_shrink_and_expand_match_the_reference(rank, subs, K, tiles, dtype):
    slots, x, a, b, out = _case(rank, subs, dtype, seed=rank + len(subs), K=K)
    order, starts, counts = segments(slots, L)
    assert counts.sum() < len(slots) and (counts > 0).sum() >= 2  # base rows and 2+ slots
    meta = np.zeros(MAX_TOKENS + 2 * L, dtype=np.int64)
    meta[: len(order)] = order
    meta[MAX_TOKENS:] = np.concatenate([starts, counts])
    groups = [(int(k), torch.from_numpy(order[starts[k] : starts[k] + counts[k]].copy()))
              for k in np.nonzero(counts)[0]]  # fmt: skip
    ranges = [(sum(subs[:k]), n) for k, n in enumerate(subs)]

    s_ref = lora_shrink_ref(x, a, groups, R)  # [S, T, R]
    want = out.clone()
    lora_expand_ref(s_ref, b, want, groups, ranges)

    dev = lambda t: t.to(DEVICE)  # noqa: E731
    meta_t = dev(torch.from_numpy(meta))
    s = lora_shrink(dev(x), dev(a), meta_t, MAX_TOKENS, R, **tiles)
    rows = torch.from_numpy(order)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(s.cpu()[:, rows], s_ref[:, rows], rtol=tol, atol=tol)
    got = dev(out.clone())
    flat = [o for o, _ in ranges] + [n for _, n in ranges]
    lora_expand(s, dev(b), got, meta_t, dev(torch.tensor(flat)), MAX_TOKENS, max(subs))
    got = got.cpu().float()
    base = slots < 0
    assert torch.equal(got[base], out.float()[base])  # base-model rows untouched
    assert not torch.allclose(want.float()[~base], out.float()[~base])  # the adapters add
    btol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(got, want.float(), rtol=btol, atol=btol)
