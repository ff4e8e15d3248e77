"""The Triton fused MoE against the reference that loops over the experts (issue 55): random
inputs in bf16 / fp16 / fp32 (IEEE dots, no TF32), 8 to 128 experts, top-1 / 2 / 8, ragged
expert loads with empty experts; and the alignment on the worked example of its docstring.

On a machine without CUDA the kernels run in Triton's interpreter on small shapes; the big
ones run only on CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import DEVICE, cuda_only

# isort: split

from pagedllm.model.layers.moe import fused_experts_ref, route
from pagedllm.ops.fused_moe import fused_moe, moe_align

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (tokens, hidden, intermediate, experts, top_k, skew): skew > 0 routes most tokens to the
# first experts (ragged loads, many experts empty)
SMALL = [(5, 64, 32, 8, 2, 0.0), (17, 32, 64, 8, 1, 4.0), (3, 64, 32, 16, 8, 0.0),
         (33, 48, 16, 8, 2, 8.0)]  # fmt: skip
BIG = [(1, 2048, 768, 128, 8, 0.0), (256, 2048, 768, 128, 8, 0.0), (64, 4096, 1024, 8, 2, 0.0),
       (512, 1024, 512, 64, 2, 6.0)]  # fmt: skip
SHAPES = [pytest.param(*s, id="-".join(map(str, s))) for s in SMALL] + [
    pytest.param(*s, id="big-" + "-".join(map(str, s)), marks=cuda_only) for s in BIG
]


def test_alignment_on_the_worked_example() -> None:
    ids = torch.tensor([[2], [0], [2], [2], [1]], device=DEVICE)
    sorted_ids, block_expert, total = moe_align(ids, 3, 2)
    assert sorted_ids.tolist() == [1, 5, 4, 5, 0, 2, 3, 5]
    assert block_expert.tolist() == [0, 1, 2, 2]
    assert total.tolist() == [8]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,skew", SHAPES)
def test_fused_moe_matches_reference(dtype, tokens, hidden, inter, experts, top_k, skew) -> None:
    gen = torch.Generator().manual_seed(tokens * 1000 + experts * 10 + top_k)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(DEVICE, dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits -= skew * torch.arange(experts) / experts  # the first experts favoured
    weights, ids = route(logits.to(DEVICE, dtype), top_k, True, dtype)
    got = fused_moe(x, w13, w2, weights, ids)
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
    if skew:
        assert torch.bincount(ids.flatten().cpu(), minlength=experts).min() == 0


@pytest.mark.parametrize("dtype", DTYPES[:1], ids=str)
def test_pairs_of_experts_elsewhere_add_nothing(dtype) -> None:
    """Expert parallelism: a pair whose expert is another rank's has the id E ("not here");
    the kernel skips it, as the reference does, and a token whose experts are all elsewhere
    gets zeros."""
    gen = torch.Generator().manual_seed(7)
    tokens, hidden, inter, experts, top_k = 9, 32, 32, 4, 2
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / 6).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / 6).to(DEVICE, dtype)
    weights, ids = route(torch.randn(tokens, 2 * experts, generator=gen).to(DEVICE, dtype),
                         top_k, True, dtype)  # fmt: skip
    ids = torch.where(ids < experts, ids, experts)  # experts 4..7 live on another rank
    ids[0] = experts
    got = fused_moe(x, w13, w2, weights, ids)
    ref = fused_experts_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    assert (ids == experts).any() and (ids < experts).any()
    assert torch.all(got[0] == 0)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_the_tuned_table_is_found_and_its_entries_run(tmp_path, monkeypatch) -> None:
    """benchmarks/tune_fused_moe.py --smoke (a tiny shape, two tiles, checked against the
    reference) writes entries that moe_config finds by shape and device, the nearest token
    count's; a shape the table lacks gets the defaults."""
    import argparse

    from benchmarks.tune_fused_moe import tune
    from pagedllm.ops import fused_moe as fm

    table = tune(argparse.Namespace(smoke=True, dtype="bfloat16", tokens="1,5", model=""))
    (key,) = table
    monkeypatch.setattr(fm, "_table", lambda: table)
    got = fm.moe_config(4, 8, 8, 64, 32, torch.bfloat16, DEVICE)
    assert got == table[key]["5"]  # 4 tokens: 5 is nearer than 1
    assert fm.moe_config(4, 8, 16, 64, 32, torch.bfloat16, DEVICE) == fm.default_config(8, 16)
