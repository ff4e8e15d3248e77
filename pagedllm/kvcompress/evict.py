"""Which KVs to evict, and the compaction that frees their blocks (torch, on the cache's device).

Everything is vectorized over the sequences being compressed and over every (layer, KV head)
of each: sorts, chunk costs, cumulative budgets and the moves are tensor operations, with no
Python loop over sequences, layers, heads or blocks, and no host sync (the caller passes the
longest head length it knows on the host).

The rule (KV-Compress, arXiv 2410.00161). For one sequence and head ``lh`` with ``len`` KVs in
``nb = cdiv(len, bs)`` blocks, its last block holding ``hanging = len - (nb - 1) * bs`` KVs:
sort the head's KVs by score, ascending (protected KVs score +inf). Freeing ``j + 1`` blocks
removes the ``hanging + j * bs`` cheapest KVs; its cost is the score of the dearest KV removed,
``sorted[hanging + j * bs - 1]``. Across every (layer, head) of the sequence, chunks are taken
cheapest first until the sequence holds at most its budget. Costs grow with ``j`` inside a
head, so a head always gives up a prefix of its sorted KVs.

Example: bs 2, one head with scores [5, 1, 9, 3, 7] (len 5, hanging 1): sorted [1, 3, 5, 7, 9]
-> chunk 0 removes 1 KV at cost 1, chunk 1 removes 2 more at cost 5, chunk 2 two more at cost 9.

Compaction: in each head, the survivors at logical index >= the new length move into the
evicted slots below it (lowest first), carrying K, V, score and position; blocks past the new
length are then free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.kvcompress.shard import HeadShard

_INF = float("inf")


def head_slots(
    tables: torch.Tensor, lens: torch.Tensor, max_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of every head's logical indices 0..max_len-1 and which are valid.

    tables: [B, LH, max_blocks] int; lens: [B, LH]. Returns slots [B, LH, max_len] int64 (0 where
    invalid) and valid [B, LH, max_len] bool. Example: bs 4, table [7, 2], len 6 ->
    slots [28, 29, 30, 31, 8, 9, 0...]."""
    idx = torch.arange(max_len, device=tables.device)
    nblk = -(-max_len // block_size)
    blk = tables[..., :nblk].long().repeat_interleave(block_size, dim=-1)[..., :max_len]
    valid = idx < lens[..., None]
    slots = torch.where(valid, blk * block_size + idx % block_size, 0)
    return slots, valid


def plan_eviction(
    scores: torch.Tensor,  # [num_slots] float32
    positions: torch.Tensor,  # [num_slots] int32
    tables: torch.Tensor,  # [B, LH, max_blocks]
    lens: torch.Tensor,  # [B, LH] int64
    budget: torch.Tensor,  # [B] int64: KVs the compressible heads may keep
    protect_from: torch.Tensor,  # [B] int64: positions >= this are never evicted
    compressible: torch.Tensor,  # [LH] bool
    max_len: int,
    block_size: int,
    num_sinks: int | torch.Tensor = 0,  # positions below are never evicted ([B] or one)
    method: str = "kvcompress",
    generator: torch.Generator | None = None,
    shard: HeadShard | None = None,
    head_floor: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Choose the evictions (see the module docstring). Returns (evict [B, LH] KVs per head,
    order [B, LH, max_len] logical indices by ascending score, slots, valid).

    ``shard``: tensor parallelism (``shard.py``); the heads given are this rank's, the
    budgets every rank's. Each head's chunk costs and length are gathered from every rank
    and the chunks chosen across all heads in the global head order, exactly as one rank
    holding every head chooses them; ``evict`` is of this rank's heads.

    ``head_floor`` (``kvcompress`` only): a chunk is not taken where it would leave its head
    with less than ``head_floor`` x an even share of the evictable budget (``_floor``)."""
    bs = block_size
    slots, valid = head_slots(tables, lens, max_len, bs)
    pos = positions[slots].long()
    evictable = (
        valid
        & compressible[None, :, None]
        & (pos < protect_from[:, None, None])
        & (pos >= (num_sinks[:, None, None] if torch.is_tensor(num_sinks) else num_sinks))
    )
    if method == "random":
        sc = torch.rand(slots.shape, generator=generator, device=slots.device)
    else:
        sc = scores[slots]
    key = torch.where(evictable, sc, _INF)
    sorted_key, order = key.sort(dim=-1, stable=True)  # [B, LH, S]

    j = torch.arange(-(-max_len // bs), device=lens.device)  # chunk numbers [J]
    nb, removed = _chunks(lens, j, bs)
    cost = sorted_key.gather(-1, (removed - 1).clamp(0, max_len - 1))
    cost = torch.where(j < nb[..., None], cost, _INF)  # [B, LH, J]
    floored = head_floor > 0 and method == "kvcompress"
    # the KVs each head must keep [B, LH, 1], counted only for a floor ([B, LH, 0] else)
    fixed = (valid & ~evictable).sum(-1, keepdim=True) if floored else lens[..., None][..., :0]
    sharded = shard is not None and shard.world > 1
    if sharded:
        # every rank's heads (one all-gather: each head's chunk costs, length, fixed KVs)
        assert shard is not None
        extra = torch.cat([lens[..., None], fixed], -1).to(cost.dtype)
        packed = shard.gather(torch.cat([cost, extra], -1))
        cost, extra = packed[..., : cost.shape[-1]], packed[..., cost.shape[-1] :].long()
        lens, fixed = extra[..., 0], extra[..., 1:]
        compressible = shard.replicate(compressible)
        nb, removed = _chunks(lens, j, bs)
    if floored:
        cost = _floor(cost, lens, removed, fixed[..., 0], budget, compressible, bs, head_floor)
    evict = _choose(cost, lens, nb, removed, budget, compressible, j, bs, method)
    if sharded:
        assert shard is not None
        evict = shard.select(evict)
    return evict, order, slots, valid


def _chunks(lens: torch.Tensor, j: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks per head [B, LH], KVs gone once chunks 0..j are taken [B, LH, J]): chunk 0
    is the ``hanging`` KVs of a head's last block, each later chunk a block.
    Example: bs 2, len 5 -> nb 3, removed [1, 3, 5]."""
    nb = -(-lens // bs)
    hanging = lens - (nb - 1) * bs  # KVs in the last block (bs when full)
    return nb, hanging[..., None] + j * bs


def _floor(
    cost: torch.Tensor,  # [B, LH, J]
    lens: torch.Tensor,  # [B, LH]
    removed: torch.Tensor,  # [B, LH, J]
    fixed: torch.Tensor,  # [B, LH] unevictable KVs (protected, sinks)
    budget: torch.Tensor,  # [B]
    compressible: torch.Tensor,  # [LH] bool
    bs: int,
    head_floor: float,
) -> torch.Tensor:
    """``cost`` with the chunks a head's floor forbids made +inf. An even split gives each of
    the ``hc`` compressible heads ``budget / hc`` KVs, ``share = budget / hc - fixed`` of them
    evictable ones; a head keeps ``floor = fixed + head_floor * share``, rounded down to where
    its chunks end: chunk j (leaving ``lens - removed[j]`` KVs, a multiple of bs) is allowed
    while that is more than ``floor - bs``. The floors sum to at most the budget, so it can
    still be met. Costs grow with j in a head, so forbidding is a suffix of its chunks.
    Example: budget 192, 3 heads, fixed 32, head_floor 0.5, bs 16 -> share 32, floor 48: a
    head of 100 KVs (removed [4, 20, 36, 52, 68, 84, 100], left [96, 80, 64, 48, 32, 16, 0])
    may give up chunks 0-3 (48 left > 32), not chunk 4 (32 left)."""
    hc = compressible.sum().clamp(min=1)
    share = (budget[:, None] / hc - fixed).clamp(min=0)  # [B, LH]
    floor = fixed + head_floor * share  # [B, LH]
    left = lens[..., None] - removed  # [B, LH, J] KVs kept once chunks 0..j are taken
    return torch.where(left > floor[..., None] - bs, cost, _INF)


def _choose(
    cost: torch.Tensor,  # [B, LH, J] each chunk's cost (inf: none, or unevictable)
    lens: torch.Tensor,  # [B, LH]
    nb: torch.Tensor,  # [B, LH]
    removed: torch.Tensor,  # [B, LH, J]
    budget: torch.Tensor,  # [B]
    compressible: torch.Tensor,  # [LH] bool
    j: torch.Tensor,  # [J]
    bs: int,
    method: str,
) -> torch.Tensor:
    """KVs to evict per head [B, LH]: the cheapest chunks across every head of each sequence
    until it holds at most its budget (``uniform``: each compressible head down to an even
    share of it)."""
    b = lens.shape[0]
    exists = j < nb[..., None]
    size = torch.where(j == 0, removed[..., :1], bs) * exists  # [B, LH, J]
    finite = torch.isfinite(cost)
    held = (lens * compressible).sum(-1)  # [B]
    need = (held - budget).clamp(min=0)  # [B]
    if method == "uniform":
        # the same budget for every compressible head of the sequence
        per_head = -(-budget // compressible.sum().clamp(min=1))  # [B]
        need_h = (lens - per_head[:, None]).clamp(min=0)  # [B, LH]
        before = removed - size  # KVs removed by the chunks before j
        taken = finite & (before < need_h[..., None]) & compressible[None, :, None]
    else:
        flat_cost = cost.reshape(b, -1)
        flat_size = size.reshape(b, -1)
        rank = flat_cost.argsort(dim=-1, stable=True)  # cheapest chunk first
        cum = flat_size.gather(-1, rank).cumsum(-1)
        before = cum - flat_size.gather(-1, rank)
        take_sorted = (before < need[:, None]) & torch.isfinite(flat_cost.gather(-1, rank))
        taken = torch.zeros_like(take_sorted).scatter_(-1, rank, take_sorted).view(cost.shape)
    return (size * taken).sum(-1)


def compact(
    kv: torch.Tensor,  # [2, num_slots, head_dim] (a view of the cache)
    scores: torch.Tensor,  # [num_slots]
    positions: torch.Tensor,  # [num_slots]
    evict: torch.Tensor,  # [B, LH]
    order: torch.Tensor,  # [B, LH, S]
    slots: torch.Tensor,  # [B, LH, S]
    valid: torch.Tensor,  # [B, LH, S]
    lens: torch.Tensor,  # [B, LH]
    max_moves: int,  # a host bound on the KVs that move (see move_bound)
    spare_slot: int,  # a slot no head uses: the unused entries of the move list copy it
) -> torch.Tensor:
    """Evict the ``evict`` cheapest KVs of each head (the first of ``order``) and move the
    survivors past the new length into the freed slots. Returns the new lengths [B, LH].
    No host sync: the moves go through a list of ``max_moves`` (src, dst) entries, the unused
    ones copying ``spare_slot`` onto itself.

    Example: len 5, KVs at logical 0..4, evict logical {1, 4} -> new len 3; the survivor at
    logical 3 moves to logical 1 (logical 4 was evicted and sits past the new length)."""
    s = order.shape[-1]
    idx = torch.arange(s, device=order.device)
    rank = torch.empty_like(order).scatter_(-1, order, idx.expand_as(order))
    evicted = rank < evict[..., None]  # [B, LH, S]
    new_lens = lens - evict
    below = idx < new_lens[..., None]
    hole = evicted & below  # freed slots below the new length ...
    mover = ~evicted & valid & ~below  # ... take the survivors past it, k-th to k-th per head
    # Example: hole [0, 1, 0, 1, 0], mover [0, 0, 0, 0, 1] -> hole_k [-, 0, -, 1, -]: the
    # head's 1st hole is logical 1; mover_k [-, -, -, -, 0]: logical 4 moves to logical 1.
    hole_k = torch.where(hole, hole.cumsum(-1) - 1, s)  # s: a dump column
    hole_slot = torch.zeros(*slots.shape[:-1], s + 1, dtype=slots.dtype, device=slots.device)
    hole_slot.scatter_(-1, hole_k, slots)
    mover_k = torch.where(mover, mover.cumsum(-1) - 1, s)
    dst_all = hole_slot.gather(-1, mover_k).reshape(-1)  # [B * LH * S]
    # the movers, in row-major order, into a list of max_moves entries (the rest: spare)
    m = mover.reshape(-1)
    at = torch.where(m, m.cumsum(0) - 1, max_moves).clamp(max=max_moves)
    src = torch.full((max_moves + 1,), spare_slot, dtype=slots.dtype, device=slots.device)
    dst = src.clone()
    src.scatter_(0, at, torch.where(m, slots.reshape(-1), spare_slot))
    dst.scatter_(0, at, torch.where(m, dst_all, spare_slot))
    if kv.device.type == "cpu":  # no sync to pay here: check the bound
        assert int(m.sum()) <= max_moves, "eviction moved more KVs than its bound"
    src, dst = src[:max_moves], dst[:max_moves]
    kv[:, dst] = kv[:, src]
    scores[dst] = scores[src]
    positions[dst] = positions[src]
    return new_lens


def width_groups(widths: list[int], ratio: int = 4) -> list[list[int]]:
    """Indices of evictions grouped so that each group's sort width (its longest head) is
    less than ``ratio`` x any member's own: one call evicts a group, padding each member to
    the group's width, and a prompt of 6,000 tokens evicted beside requests holding a few
    hundred KVs a head would otherwise pad them all to 6,000. Longest first.
    Example: widths [6000, 300, 5000, 900, 250] -> [[0, 2], [3, 1, 4]]; 200 instead of
    250 would be a third group (4 x 200 <= 900)."""
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and widths[i] * ratio > widths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def move_bound(
    held: int, budget: int, block_size: int, method: str, stuck: int | None = None
) -> int:
    """KVs an eviction of one request may move, at most: no more than it evicts, which is
    below ``held - budget + block_size`` (whole chunks are taken while fewer than
    ``held - budget`` are gone; a chunk is at most a block) except with ``uniform``, whose
    per-head budgets can take more (bounded by ``held``).

    Nor more than survive: the chunks taken leave at most ``budget`` KVs, unless every
    evictable chunk goes, which leaves fewer than each head's unevictable KVs plus a block.
    ``stuck`` bounds that sum over the compressible heads (``stuck_bound``); given, the bound
    is also at most ``max(budget, stuck)``. A prompt of 6,000 tokens kept to 128 KVs in each
    of 256 heads moves at most 32,768 KVs, not 1.5 million: the move list is that long.
    Example: held 1000, budget 600, bs 16 -> 415; held 1000, budget 100, stuck 300 -> 300."""
    if method == "uniform":
        return max(held, 0)
    bound = max(min(held, held - budget + block_size - 1), 0)
    if stuck is not None:
        bound = min(bound, max(budget, stuck, 0))
    return bound


def stuck_bound(
    num_heads: int, computed: int, protect_from: int, sinks: int, block_size: int
) -> int:
    """A bound on the KVs ``num_heads`` compressible heads keep when every evictable chunk is
    taken: each head keeps its unevictable KVs (positions >= ``protect_from`` among the
    ``computed`` tokens', positions below ``sinks``; a head holds a position once) and less
    than a block beside them (a chunk whose last KV is unevictable stays whole).
    Example: 256 heads, computed 6,000, protect_from 5,968, no sinks, bs 16 ->
    256 * (32 + 15) = 12,032."""
    unevictable = max(computed - protect_from, 0) + min(max(sinks, 0), max(computed, 0))
    return num_heads * (unevictable + block_size - 1)


def maxpool_scores(metric: torch.Tensor, valid: torch.Tensor, kernel: int) -> torch.Tensor:
    """Max-pool ``metric`` [..., S] along the sequence (kernel ``kernel``, same length),
    over valid entries only (invalid ones count as 0, below any squared probability sum)."""
    shape = metric.shape
    x = torch.where(valid, metric, 0.0).reshape(-1, 1, shape[-1])
    pooled = torch.nn.functional.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    return pooled.reshape(shape)
