"""KV-Compress's per-step slot computation in two Triton launches (``kvc_step_slots``).

Each step, every new token of a request takes one KV slot in each of its (layer, KV head)
pairs, right after that head's current length: token t of request row ``row`` at offset ``o``
(0 for its first token this step) goes to logical index ``lens[row, lh] + o`` of head ``lh``,
i.e. slot ``tables[row, lh, idx // bs] * bs + idx % bs``. The slot's position is set to the
token's position and its score to 0, and the row's lengths advance by its token count.

The step's new table entries (the blocks the scheduler added since the last step, as flat
indices into ``tables`` and block ids) are written first, so that a token whose KV starts a
new block finds it.

In PyTorch that is a dozen small kernels (a scatter of the entries, gathers, index arithmetic,
two scatters, a fill), and on the GPU their launches cost more host time than the rest of a
decode step's KV-Compress bookkeeping: here the first launch writes the table entries and
advances the lengths (one program per request and block of heads, then one per block of
entries), the second does the slots, positions and scores (one program per token and block of
heads) from the advanced lengths less the request's tokens.
``pagedllm.kvcompress.cache.step_slots_torch`` is the reference, and the path on the CPU.

Example: bs 4, one head, a request in row 2 with lens [5] and table [3, 8], scheduled 2
tokens at positions 5, 6 -> logical 5, 6 -> slots 8*4+1, 8*4+2 = [33, 34]; positions[33] = 5,
positions[34] = 6, scores 0 there; lens[2] becomes [7].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# counts and index views vary step by step: no specialization on their values or alignment
# (each new variant is a Triton compile, seconds, inside whatever step first meets it)
@triton.jit(
    do_not_specialize=["num_reqs", "num_entries"],
    do_not_specialize_on_alignment=["rows_ptr", "n_ptr", "flat_ptr", "ids_ptr"],
)
def _advance_kernel(
    lens_ptr,  # [rows, LH] int64 in/out
    rows_ptr,  # [R] int64
    n_ptr,  # [R] int64 tokens of each request this step
    tables_ptr,  # [rows * LH * max_blocks] int32, the entries written
    flat_ptr,  # [E] int64 flat index of each new entry
    ids_ptr,  # [E] int64 its block id
    num_reqs,
    num_entries,
    num_heads,
    BLOCK_LH: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    p = tl.program_id(0)
    hb = tl.program_id(1)
    if p < num_reqs:  # the request's lengths advance by its tokens
        row = tl.load(rows_ptr + p)
        n = tl.load(n_ptr + p)
        lh = hb * BLOCK_LH + tl.arange(0, BLOCK_LH)
        mask = lh < num_heads
        ptr = lens_ptr + row * num_heads + lh
        tl.store(ptr, tl.load(ptr, mask=mask, other=0) + n, mask=mask)
    elif hb == 0:  # a block of the new table entries
        e = (p - num_reqs) * BLOCK_E + tl.arange(0, BLOCK_E)
        mask = e < num_entries
        flat = tl.load(flat_ptr + e, mask=mask, other=0)
        ids = tl.load(ids_ptr + e, mask=mask, other=0).to(tl.int32)
        tl.store(tables_ptr + flat, ids, mask=mask)


@triton.jit(
    do_not_specialize_on_alignment=[
        "rows_ptr",
        "n_ptr",
        "req_idx_ptr",
        "offsets_ptr",
        "tok_pos_ptr",
    ]
)
def _slots_kernel(
    tables_ptr,  # [rows, LH, max_blocks] int32
    lens_ptr,  # [rows, LH] int64, already advanced by the step's tokens
    rows_ptr,  # [R] int64 table row of each request
    n_ptr,  # [R] int64 tokens of each request this step
    req_idx_ptr,  # [T] int64 request of each token
    offsets_ptr,  # [T] int64 token's offset within its request's tokens this step
    tok_pos_ptr,  # [T] int64 token positions
    slots_ptr,  # [T, LH] int64 out
    positions_ptr,  # [num_slots] int32 in/out
    scores_ptr,  # [num_slots] float32 in/out
    num_heads,
    max_blocks,
    BS: tl.constexpr,
    BLOCK_LH: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    r = tl.load(req_idx_ptr + t)
    row = tl.load(rows_ptr + r)
    off = tl.load(offsets_ptr + t) - tl.load(n_ptr + r)  # from the lengths before the step
    pos = tl.load(tok_pos_ptr + t).to(tl.int32)
    lh = hb * BLOCK_LH + tl.arange(0, BLOCK_LH)
    mask = lh < num_heads
    length = tl.load(lens_ptr + row * num_heads + lh, mask=mask, other=0)
    idx = length + off
    blk = tl.load(
        tables_ptr + (row * num_heads + lh) * max_blocks + idx // BS, mask=mask, other=0
    ).to(tl.int64)
    slot = blk * BS + idx % BS
    tl.store(slots_ptr + t * num_heads + lh, slot, mask=mask)
    tl.store(positions_ptr + slot, tl.zeros_like(lh) + pos, mask=mask)
    tl.store(scores_ptr + slot, tl.zeros([BLOCK_LH], dtype=tl.float32), mask=mask)


def kvc_step_slots(
    tables: torch.Tensor,  # [rows, LH, max_blocks] int32
    lens: torch.Tensor,  # [rows, LH] int64, advanced in place
    rows: torch.Tensor,  # [R] int64
    req_idx: torch.Tensor,  # [T] int64
    offsets: torch.Tensor,  # [T] int64
    n_sched: torch.Tensor,  # [R] int64
    token_positions: torch.Tensor,  # [T] int64
    positions: torch.Tensor,  # [num_slots] int32, written at the new slots
    scores: torch.Tensor,  # [num_slots] float32, zeroed at the new slots
    block_size: int,
    entry_index: torch.Tensor | None = None,  # [E] int64 flat indices into ``tables``
    entry_ids: torch.Tensor | None = None,  # [E] int64 the block ids written there
) -> torch.Tensor:
    """The step's new slots [T, LH] (see the module docstring), after writing the new table
    entries; the rows of ``rows`` must be distinct (one request per row) and the entries'
    indices distinct."""
    num_tokens, num_heads = req_idx.shape[0], tables.shape[1]
    slots = torch.empty((num_tokens, num_heads), dtype=torch.int64, device=tables.device)
    num_entries = 0 if entry_index is None else entry_index.shape[0]
    if num_entries == 0:
        entry_index = entry_ids = rows  # (never read)
    num_reqs = rows.shape[0]
    if num_reqs == 0 and num_entries == 0:
        return slots
    block_lh = min(256, triton.next_power_of_2(num_heads))
    nhb = triton.cdiv(num_heads, block_lh)
    block_e = 1024
    grid = (num_reqs + triton.cdiv(num_entries, block_e), nhb)
    _advance_kernel[grid](
        lens, rows, n_sched, tables, entry_index, entry_ids, num_reqs, num_entries, num_heads,
        BLOCK_LH=block_lh, BLOCK_E=block_e,
    )  # fmt: skip
    if num_tokens:
        _slots_kernel[(num_tokens, nhb)](
            tables, lens, rows, n_sched, req_idx, offsets, token_positions, slots, positions,
            scores, num_heads, tables.shape[2], BS=block_size, BLOCK_LH=block_lh,
        )  # fmt: skip
    return slots
