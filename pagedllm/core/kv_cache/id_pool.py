"""Block ids of the per-head KV manager (``head_paged.py``): reference counts and stacks of
free ids, one pool per device (a tensor-parallel rank holds a pool of its own)."""

from __future__ import annotations

import numpy as np


class _RefCounted:
    """Reference counting shared by the pools: ``ref`` [num_blocks] and a ``push`` of ids
    back to the free stack(s)."""

    ref: np.ndarray

    def push(self, dead: np.ndarray) -> None:
        raise NotImplementedError

    def release(self, ids: np.ndarray) -> None:
        """Drop one reference of each id (distinct ids: the blocks of one request's table);
        ids at 0 go back on the stack."""
        self.push(self.drop(ids))

    def drop(self, ids: np.ndarray) -> np.ndarray:
        """Drop one reference of each (distinct) id; returns those now at 0, not yet free."""
        if len(ids) == 0:
            return ids
        self.ref[ids] -= 1
        return ids[self.ref[ids] == 0]


class IdPool(_RefCounted):
    """Block ids with reference counts and a stack of free ids (one pool: one device)."""

    parts = 1

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = np.zeros(num_blocks, dtype=np.int32)
        self.stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)  # pops 0, 1, 2 ...
        self.num_free = num_blocks

    def take(self, n: int) -> np.ndarray | None:
        if n > self.num_free:
            return None
        ids = self.stack[self.num_free - n : self.num_free][::-1].copy()
        self.num_free -= n
        self.ref[ids] = 1
        return ids

    def take_parts(self, parts: np.ndarray) -> np.ndarray | None:
        """An id for each entry of ``parts`` (each entry's pool: here always the one)."""
        return self.take(len(parts))

    def free_by_part(self) -> np.ndarray:
        """[parts] free ids of each part."""
        return np.array([self.num_free], dtype=np.int64)

    def part_of(self, ids: np.ndarray) -> np.ndarray:
        """The part of each id."""
        return np.zeros(len(ids), dtype=np.int64)

    def push(self, dead: np.ndarray) -> None:
        """Ids at reference 0 back on the stack."""
        self.stack[self.num_free : self.num_free + len(dead)] = dead[::-1]
        self.num_free += len(dead)

    def check(self, held: np.ndarray, parked: int = 0) -> None:
        """Ref counts equal the tables' holdings; ``parked`` blocks are at 0 but not free (a
        prefix cache's unused entries)."""
        refs = np.bincount(held, minlength=self.num_blocks)
        assert np.array_equal(self.ref, refs), (
            "a block's ref count differs from the tables holding it"
        )
        free = self.stack[: self.num_free]
        assert len(np.unique(free)) == self.num_free, "a block is free twice"
        assert not np.any(self.ref[free]), "a free block is referenced"
        assert int((self.ref > 0).sum()) + self.num_free + parked == self.num_blocks


class PartedIdPool(_RefCounted):
    """Tensor parallelism: ``parts`` pools of ``part_size`` ids with one array of reference
    counts. Part r (rank r's device pool) holds ids ``r * part_size`` to
    ``(r + 1) * part_size - 1``: an id's part is ``id // part_size``, and rank r's device
    knows the block as ``id - r * part_size``. The methods of ``IdPool`` but ``take``: ids
    are taken by part (``take_parts``).

    Example: part_size 4, 2 parts; take_parts([1, 0, 1]) -> [4, 0, 5]."""

    def __init__(self, part_size: int, parts: int) -> None:
        self.part_size = part_size
        self.parts = parts
        self.num_blocks = part_size * parts
        self.ref = np.zeros(self.num_blocks, dtype=np.int32)
        # each part's stack of free ids (global ids), and how many of it are free
        self.stacks = [
            np.arange((r + 1) * part_size - 1, r * part_size - 1, -1, dtype=np.int32)
            for r in range(parts)
        ]
        self.free = np.full(parts, part_size, dtype=np.int64)

    @property
    def num_free(self) -> int:
        return int(self.free.sum())

    def free_by_part(self) -> np.ndarray:
        return self.free.copy()

    def part_of(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(ids, dtype=np.int64) // self.part_size

    def take_parts(self, parts: np.ndarray) -> np.ndarray | None:
        """An id of part ``parts[i]`` for each entry i (refs 1); None (nothing taken) when a
        part has too few free."""
        need = np.bincount(parts, minlength=self.parts)
        if np.any(need > self.free):
            return None
        ids = np.empty(len(parts), dtype=np.int32)
        for r in np.flatnonzero(need).tolist():
            n, top = int(need[r]), int(self.free[r])
            ids[parts == r] = self.stacks[r][top - n : top][::-1]
            self.free[r] = top - n
        self.ref[ids] = 1
        return ids

    def push(self, dead: np.ndarray) -> None:
        """Ids at reference 0 back on their parts' stacks."""
        if len(dead) == 0:
            return
        part = self.part_of(dead)
        for r in np.unique(part).tolist():
            mine = dead[part == r]
            top = int(self.free[r])
            self.stacks[r][top : top + len(mine)] = mine[::-1]
            self.free[r] = top + len(mine)

    def check(self, held: np.ndarray, parked: int = 0) -> None:
        refs = np.bincount(held, minlength=self.num_blocks)
        assert np.array_equal(self.ref, refs), (
            "a block's ref count differs from the tables holding it"
        )
        for r, stack in enumerate(self.stacks):
            free = stack[: int(self.free[r])]
            assert len(np.unique(free)) == len(free), "a block is free twice"
            assert np.all(free // self.part_size == r), "a block is free in another rank's pool"
            assert not np.any(self.ref[free]), "a free block is referenced"
        assert int((self.ref > 0).sum()) + self.num_free + parked == self.num_blocks


def make_id_pool(part_size: int, parts: int) -> IdPool | PartedIdPool:
    """One pool of ``part_size`` ids, or ``parts`` of them (tensor parallelism)."""
    return IdPool(part_size) if parts == 1 else PartedIdPool(part_size, parts)
