"""KV-Compress's per-step slot kernel (pagedllm/ops/kvc_step.py) against its PyTorch
reference (``step_slots_torch``): the step's new table entries written first, the slots of
every new token in every head, the positions and zero scores written there, the lengths
advanced, and nothing else touched."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_setup import DEVICE

# isort: split

from pagedllm.kvcompress.cache import step_slots_torch
from pagedllm.ops.kvc_step import kvc_step_slots


def _case(
    seed: int, num_heads: int, bs: int, n_sched: list[int], max_rows: int = 12
) -> tuple[dict, int]:
    g = torch.Generator().manual_seed(seed)
    max_blocks = 20
    num_blocks = max_rows * num_heads * max_blocks + 1
    tables = torch.randperm(num_blocks - 1, generator=g)[: max_rows * num_heads * max_blocks]
    tables = tables.view(max_rows, num_heads, max_blocks).to(torch.int32)
    r = len(n_sched)
    rows = torch.randperm(max_rows, generator=g)[:r].long()
    n = torch.tensor(n_sched, dtype=torch.int64)
    # each head its own length, with room for the step's tokens in its table
    lens = torch.randint(0, (max_blocks - 2) * bs, (max_rows, num_heads), generator=g)
    req_idx = torch.repeat_interleave(torch.arange(r), n)
    offsets = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
    token_positions = torch.randint(0, 10_000, (int(n.sum()),), generator=g)
    # (room for the fresh entries' blocks below)
    num_slots = (num_blocks + 2 * max_rows * num_heads) * bs
    positions = torch.randint(-5, 5, (num_slots,), generator=g).to(torch.int32)
    scores = torch.rand(num_slots, generator=g) + 1.0  # never 0 before the step
    # new table entries: for each scheduled row, the block holding each head's next KV and
    # the one after it get fresh ids (the tokens must read them, not the old ones)
    flat, ids = [], []
    fresh = num_blocks  # ids past the table's (the slots differ from the old ones')
    for row in rows.tolist():
        for lh in range(num_heads):
            first = int(lens[row, lh]) // bs
            for index in (first, first + 1):
                flat.append((row * num_heads + lh) * max_blocks + index)
                ids.append(fresh)
                fresh += 1
    args = dict(
        tables=tables, lens=lens, rows=rows, req_idx=req_idx, offsets=offsets, n_sched=n,
        token_positions=token_positions, positions=positions, scores=scores,
        entry_index=torch.tensor(flat, dtype=torch.int64),
        entry_ids=torch.tensor(ids, dtype=torch.int64),
    )  # fmt: skip
    return {k: v.to(DEVICE) for k, v in args.items()}, bs


@pytest.mark.parametrize(
    "num_heads,bs,n_sched",
    [
        (6, 4, [1, 1, 1]),  # decodes
        (6, 4, [5, 1, 9, 2]),  # prefill chunks crossing blocks, and decodes
        (224, 16, [1] * 7 + [33]),  # Qwen3-0.6B: 28 layers x 8 KV heads, one block of 256
        (300, 8, [3, 1]),  # two blocks of 256 heads, the second one masked
        (4, 4, []),  # an empty step
    ],
)
def test_step_slots_match_reference(num_heads: int, bs: int, n_sched: list[int]) -> None:
    ref, bs = _case(0, num_heads, bs, n_sched)
    got = {k: v.clone() for k, v in ref.items()}
    slots_ref = step_slots_torch(**ref, block_size=bs)
    slots = kvc_step_slots(**got, block_size=bs)
    assert slots.shape == (sum(n_sched), num_heads)
    if n_sched:  # the entries were written, and the slots are in their blocks
        flat = ref["entry_index"]
        assert torch.equal(got["tables"].view(-1)[flat], ref["entry_ids"].to(torch.int32))
        first = slots[ref["offsets"] == 0]  # each request's first token: in a new block
        assert bool((first // bs >= int(ref["entry_ids"].min())).all())
    torch.testing.assert_close(slots, slots_ref, rtol=0, atol=0)
    for name in ("lens", "positions", "scores", "tables"):
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0, msg=name)
    if n_sched:
        flat = slots.reshape(-1)
        assert len(torch.unique(flat)) == len(flat), "two new KVs in one slot"
        assert bool((got["scores"][flat] == 0).all())
        want = got["token_positions"].to(torch.int32)[:, None].expand_as(slots).reshape(-1)
        assert torch.equal(got["positions"][flat], want)
