"""A picture of the device block pool at one moment: every block's state and one request that
holds it (``KVCacheManagerBase.block_map``). The dashboard draws it (``pagedllm/dashboard``);
it is read between steps, never on the hot path.

States, one per block:
    FREE      on the free list, holding nothing anyone can find
    CACHED    free, but its contents are a prefix-cache entry (evictable, least recently used
              first)
    USED      held by exactly one request
    SHARED    held by several requests (a shared prefix, a fork's copy-on-write blocks)
    RESERVED  never handed out (the hybrid manager's null block)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

FREE, CACHED, USED, SHARED, RESERVED = range(5)
STATE_NAMES = ("free", "cached", "used", "shared", "reserved")


@dataclass(frozen=True)
class BlockMap:
    """Every block's state (the codes above) and the index in ``request_ids`` of one request
    holding it (-1 when none), with the blocks each request holds.

    A sampled map (``stride`` > 1; a pool too big to read whole a few times a second) lists
    blocks 0, stride, 2 * stride, ... only, names no owners (-1), and carries the exact
    ``exact_counts`` of the whole pool."""

    state: np.ndarray  # [num_blocks / stride] uint8
    owner: np.ndarray  # [num_blocks / stride] int32
    request_ids: tuple[str, ...]
    request_blocks: np.ndarray  # [len(request_ids)] int64: blocks each request holds
    stride: int = 1
    total: int | None = None  # blocks in the pool (sampled maps)
    exact_counts: dict[str, int] | None = None

    @property
    def num_blocks(self) -> int:
        return self.total if self.total is not None else len(self.state)

    def counts(self) -> dict[str, int]:
        """Blocks in each state, by name."""
        if self.exact_counts is not None:
            return dict(self.exact_counts)
        n = np.bincount(self.state, minlength=len(STATE_NAMES))
        return {name: int(n[i]) for i, name in enumerate(STATE_NAMES)}


def build_block_map(
    num_blocks: int,
    tables: Iterable[tuple[str, Sequence[int] | np.ndarray]],
    cached: Sequence[int] | np.ndarray = (),
    reserved: Sequence[int] | np.ndarray = (),
) -> BlockMap:
    """The map from every request's block ids (``tables``: (request id, ids); a request may
    appear several times, once per KV group), the ids of cached entries, and the ids never
    handed out. A cached id that a request holds is USED (or SHARED), not CACHED.

    Example: 6 blocks, tables [("a", [0, 1]), ("b", [1, 2])], cached [1, 4], reserved [5]
    -> states [USED, SHARED, USED, FREE, CACHED, RESERVED], owners [0, 1, 1, -1, -1, -1]
    (a shared block names the last request seen holding it), request_blocks [2, 2].
    """
    index: dict[str, int] = {}
    parts: list[np.ndarray] = []
    who: list[np.ndarray] = []
    for rid, ids in tables:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if rid not in index:
            index[rid] = len(index)
        parts.append(arr)
        who.append(np.full(len(arr), index[rid], dtype=np.int32))
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    owners = np.concatenate(who) if who else np.zeros(0, dtype=np.int32)
    refs = np.bincount(ids, minlength=num_blocks)[:num_blocks]
    state = np.full(num_blocks, FREE, dtype=np.uint8)
    cached_ids = np.asarray(cached, dtype=np.int64)
    state[cached_ids] = CACHED
    state[refs == 1] = USED
    state[refs > 1] = SHARED
    owner = np.full(num_blocks, -1, dtype=np.int32)
    owner[ids] = owners
    reserved_ids = np.asarray(reserved, dtype=np.int64)
    state[reserved_ids] = RESERVED
    owner[reserved_ids] = -1
    request_blocks = np.bincount(owners, minlength=len(index)).astype(np.int64)
    return BlockMap(state, owner, tuple(index), request_blocks)


def downsample(bmap: BlockMap, max_cells: int) -> tuple[int, np.ndarray, np.ndarray]:
    """At most ``max_cells`` cells of ``k`` consecutive blocks each: (k, each cell's most
    common state (ties to the higher code: a cell half used shows as used), the owner of the
    cell's first block in that state). ``k`` counts the map's entries: a sampled map's cell
    covers ``k * stride`` blocks.

    Example: states [USED, FREE, FREE, CACHED, USED], max_cells 3 -> k 2, cells (USED|FREE:
    USED), (FREE|CACHED: CACHED), (USED: USED)."""
    n = len(bmap.state)
    k = max(1, -(-n // max(1, max_cells)))
    cells = -(-n // k)
    pad = cells * k - n  # padding takes code 7, counted in a column nobody reads
    state = np.concatenate([bmap.state, np.full(pad, 7, np.uint8)]).reshape(cells, k)
    owner = np.concatenate([bmap.owner, np.full(pad, -1, np.int32)]).reshape(cells, k)
    # one bincount for every (cell, state): cell c's counts are entries [8c, 8c + 5)
    keyed = state + (np.arange(cells, dtype=np.int64) * 8)[:, None]  # [cells, k]
    counts = np.bincount(keyed.ravel(), minlength=cells * 8).reshape(cells, 8)
    counts = counts[:, : len(STATE_NAMES)]  # [cells, 5]
    # argmax of the reversed columns: the highest code among the most common
    top = len(STATE_NAMES) - 1 - np.argmax(counts[:, ::-1], axis=1)  # [cells]
    if k == 1:
        return k, top.astype(np.uint8), owner[:, 0]
    first = np.argmax(state == top[:, None], axis=1)  # [cells] first block in that state
    return k, top.astype(np.uint8), owner[np.arange(cells), first]
