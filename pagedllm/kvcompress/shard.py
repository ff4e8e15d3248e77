"""KV-Compress under tensor parallelism: one rank's share of the per-head tables.

The scheduler's per-head manager (``core/kv_cache/head_paged.py``) tables every rank's KV
heads in the model's order: head ``lh = l * H + h``, H the KV heads of a layer over all
ranks. Rank r holds heads ``h = r * Hr .. (r + 1) * Hr - 1`` of every layer (Hr = H / ranks:
the model shards its KV heads so), in a pool of its own whose blocks the scheduler numbers
``r * N .. (r + 1) * N - 1`` (N: one rank's pool; host blocks likewise with one rank's host
pool). On rank r's device global head ``l * H + r * Hr + j`` is local head ``l * Hr + j`` and
block ``r * N + i`` is block i.

``HeadShard`` translates the scheduler's plain data (whole tables, new entries, block pairs)
into the rank's own, and on the device gathers every rank's per-head tensors into the global
head order: an eviction chooses its chunks across every head of the request, as on one rank
(``evict.plan_eviction``), and each rank's new lengths reach the scheduler with the others'.

Example: 2 layers, H 2 over 2 ranks, N 100: global heads 0..3 are (l0 h0, l0 h1, l1 h0,
l1 h1); rank 1 holds heads 1 and 3 (its local heads 0 and 1), and the scheduler's block 107
is its block 7.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.core.kv_cache.head_paged import HeadBlocks, HeadTable
from pagedllm.distributed.parallel_state import all_gather_stack


class HeadShard:
    """Rank ``rank`` of ``world``'s share of ``num_layers`` x ``heads * world`` KV heads (see
    the module docstring). ``num_blocks`` / ``num_host_blocks``: the rank's pools, set when
    they are allocated. With one rank every translation is the identity."""

    def __init__(self, rank: int, world: int, num_layers: int, heads: int) -> None:
        self.rank = rank
        self.world = world
        self.num_layers = num_layers
        self.heads = heads  # Hr: this rank's KV heads of a layer
        total = heads * world  # H
        lh = np.arange(num_layers * total)
        self.mine = (lh % total) // heads == rank  # [LH] bool: the heads this rank holds
        self.local = np.full(len(lh), -1, dtype=np.int64)  # [LH] global head -> local head
        self.local[self.mine] = np.arange(num_layers * heads)
        self.num_blocks = 0
        self.num_host_blocks = 0

    # ---------------------------------------------------- the scheduler's plain data
    def table(self, head: HeadTable) -> HeadTable:
        """A request's whole table [LH, n] -> the rank's rows [L * Hr, n] in its block ids
        (entries past a head's blocks, 0 in the scheduler's table, stay 0)."""
        if self.world == 1:
            return head
        base = self.rank * self.num_blocks
        rows = head.table[self.mine]
        return HeadTable(
            np.maximum(rows - base, 0).astype(np.int32), np.asarray(head.lens)[self.mine]
        )

    def blocks(self, new: HeadBlocks) -> HeadBlocks:
        """New table entries -> those of the rank's heads, in its head and block numbers."""
        if self.world == 1:
            return new
        keep = self.mine[new.lh]
        return HeadBlocks(
            self.local[new.lh[keep]], new.index[keep], new.ids[keep] - self.rank * self.num_blocks
        )

    def copies(self, new: HeadBlocks, src: np.ndarray) -> tuple[HeadBlocks, np.ndarray]:
        """Entries ``new`` that take copies of blocks ``src`` (aligned) -> the rank's."""
        if self.world == 1:
            return new, src
        keep = self.mine[new.lh]
        return self.blocks(new), np.asarray(src)[keep] - self.rank * self.num_blocks

    def block_pairs(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Device block pairs (a copy within one head) -> the rank's, in its ids."""
        if self.world == 1 or not pairs:
            return pairs
        lo = self.rank * self.num_blocks
        hi = lo + self.num_blocks
        return [(a - lo, b - lo) for a, b in pairs if lo <= a < hi]

    def swap_pairs(self, pairs: list[tuple[int, int]], device_first: bool) -> list[tuple[int, int]]:
        """Device <-> host pairs ((device, host) when ``device_first``, else (host, device))
        -> the rank's, in its device and host ids. (Every rank's host pool has the same size:
        each sizes it from the same block bytes and swap space.)"""
        if self.world == 1 or not pairs:
            return pairs
        lo, n = self.rank * self.num_blocks, self.num_blocks
        hlo = self.rank * self.num_host_blocks
        if device_first:
            return [(d - lo, h - hlo) for d, h in pairs if lo <= d < lo + n]
        return [(h - hlo, d - lo) for h, d in pairs if lo <= d < lo + n]

    # ---------------------------------------------------------------- device side
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` [B, L * Hr, ...] (its heads) -> [B, L * H, ...] in the global
        head order (an all-gather over the tensor-parallel group).

        Example: L 2, Hr 1, 2 ranks: rank 0's [a0, a1], rank 1's [b0, b1] -> [a0, b0, a1, b1]."""
        if self.world == 1:
            return x
        parts = all_gather_stack(x)  # [T, B, L * Hr, ...]
        b, rest = x.shape[0], x.shape[2:]
        parts = parts.view(self.world, b, self.num_layers, self.heads, *rest)
        # [B, L, T, Hr, ...]: the heads of layer l, rank by rank
        return parts.movedim(0, 2).reshape(b, self.num_layers * self.heads * self.world, *rest)

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L * H, ...] in the global head order -> [B, L * Hr, ...] this rank's heads."""
        if self.world == 1:
            return x
        b, rest = x.shape[0], x.shape[2:]
        parts = x.view(b, self.num_layers, self.world, self.heads, *rest)[:, :, self.rank]
        return parts.reshape(b, self.num_layers * self.heads, *rest)

    def replicate(self, x: torch.Tensor) -> torch.Tensor:
        """A per-layer property of this rank's heads [L * Hr] (the same on every rank, e.g.
        compressibility) -> [L * H] every rank's."""
        if self.world == 1:
            return x
        h = self.heads
        return x.view(self.num_layers, 1, h).expand(-1, self.world, -1).reshape(-1)
