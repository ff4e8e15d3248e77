"""KV-Compress under tensor parallelism, without a model: the per-head manager's pools per
rank (each head's blocks from its rank's pool, an allocation fits only where every rank's
pool does), one rank's view of the scheduler's tables (``HeadShard``), and the eviction that
chooses across every rank's heads exactly as one rank holding all of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pagedllm.kvcompress.shard as shard_mod
from pagedllm.core.kv_cache.head_paged import HeadBlocks, HeadPagedKVCacheManager, HeadTable
from pagedllm.core.kv_cache.spec import HeadPagedSpec
from pagedllm.kvcompress.evict import plan_eviction
from pagedllm.kvcompress.shard import HeadShard
from tests.core.test_kvcompress import BS, _cache, _req, _start, _tok_req


def _tp_spec(layers: int = 3, heads: int = 1, ranks: int = 2) -> HeadPagedSpec:
    """``heads`` KV heads of each layer on each of ``ranks`` ranks."""
    return HeadPagedSpec(
        BS, heads, 8, 4, num_layers=layers, compressible=(True,) * layers, num_ranks=ranks
    )


def test_each_head_takes_blocks_from_its_ranks_pool():
    """3 layers x 2 KV heads over 2 ranks (12 blocks each): heads 0, 2, 4 are rank 0's (ids
    0-11), 1, 3, 5 rank 1's (ids 12-23). After an eviction that frees rank 0's blocks only,
    a step that needs more of rank 1's blocks than it has does not fit, though the pools
    hold enough blocks together."""
    kv = HeadPagedKVCacheManager(_tp_spec(), num_blocks=12)
    assert kv.num_heads == 6 and kv.num_blocks == 24 and kv.owner.tolist() == [0, 1] * 3
    assert kv.token_capacity() == 12 // 3 * BS  # each rank holds 3 heads of a token
    r = _req("a", 10)
    blocks = kv.allocate_slots(r, 10)
    assert blocks is not None and len(blocks) == 18  # cdiv(10, 4) = 3 a head
    assert np.array_equal(blocks.ids // 12, kv.owner[blocks.lh])
    assert kv._rank_free().tolist() == [3, 3] and kv.num_free_blocks() == 6
    r.num_computed_tokens = 10
    kv.check_integrity()
    # rank 0's heads keep 1 KV (2 blocks each freed), rank 1's all 10
    assert kv.apply_compaction(r, np.array([1, 10, 1, 10, 1, 10])) == 6
    assert kv._rank_free().tolist() == [9, 3]
    # 8 more tokens: rank 1's heads need 2 blocks each (6 > its 3), rank 0's 1 each
    assert kv.blocks_short(r, 8) == 3
    assert kv.allocate_slots(r, 8) is None
    kv.check_integrity()
    # 4 more: one block for each head of both ranks
    new = kv.allocate_slots(r, 4)
    assert new is not None and sorted(new.lh.tolist()) == list(range(6))
    assert np.array_equal(new.ids // 12, kv.owner[new.lh])
    assert kv._rank_free().tolist() == [6, 0]
    kv.check_integrity()
    kv.free(r)
    kv.check_integrity()
    assert kv.is_idle_clean()


def test_admission_counts_the_fullest_rank():
    """A new request fits only when every rank's pool holds its heads' blocks."""
    kv = HeadPagedKVCacheManager(_tp_spec(layers=2), num_blocks=8)
    a = _req("a", 12)  # 3 blocks a head: 6 of each rank's 8
    assert kv.allocate_slots(a, 12) is not None
    a.num_computed_tokens = 12
    kv.apply_compaction(a, np.array([1, 12, 1, 12]))  # rank 0: 4 blocks back
    assert kv._rank_free().tolist() == [6, 2]
    b = _req("b", 8)  # 2 blocks a head: 4 of each rank's
    assert not kv.can_allocate(b, 100)
    assert kv.allocate_slots(b, 8) is None
    assert kv.can_allocate(b, 4)  # a first chunk of 4 tokens: 2 blocks of each
    assert kv.allocate_slots(b, 4) is not None
    kv.check_integrity()


def test_swap_keeps_each_ranks_blocks_in_its_host_pool():
    kv = HeadPagedKVCacheManager(_tp_spec(), num_blocks=12, num_host_blocks=10)
    r = _req("a", 10)
    assert kv.allocate_slots(r, 10) is not None
    r.num_computed_tokens = 10
    out = kv.swap_out(r)
    assert out is not None and len(out) == 18
    assert all(dev // 12 == host // 10 for dev, host in out)  # rank r's blocks: r's host pool
    assert kv.is_idle_clean()
    kv.check_integrity()
    back = kv.swap_in(r)
    assert back is not None
    assert all(host // 10 == dev // 12 for host, dev in back)
    kv.check_integrity()
    kv.free(r)
    assert kv.is_idle_clean()
    kv.check_integrity()


def test_parked_entries_give_every_rank_their_blocks():
    """A cached entry holds a block of every head, on every rank: parked, it counts free on
    each, and a rank short of blocks takes parked entries back (oldest first)."""
    kv = HeadPagedKVCacheManager(_tp_spec(layers=1), num_blocks=6, enable_caching=True)
    a = _tok_req("a", list(range(3, 11)))  # 8 tokens: 2 full blocks in each of 2 heads
    assert _start(kv, a) == 0 and len(kv.cache) == 2
    kv.free(a)
    assert len(kv.parked) == 2 and kv._rank_free().tolist() == [6, 6]
    kv.check_integrity()
    b = _tok_req("b", list(range(100, 124)))  # 24 tokens: 6 blocks of each rank
    assert kv.can_allocate(b, 100)
    assert _start(kv, b) == 0
    assert not kv.parked and kv._rank_free().tolist() == [0, 0]
    kv.check_integrity()


def test_shard_translates_the_schedulers_tables():
    """The module docstring's example: 2 layers, 2 KV heads over 2 ranks, 100 blocks each;
    rank 1 holds global heads 1 and 3 (its 0 and 1) and block 107 is its block 7."""
    shard = HeadShard(1, 2, num_layers=2, heads=1)
    shard.num_blocks, shard.num_host_blocks = 100, 10
    table = HeadTable(
        np.array([[3, 4, 0], [107, 150, 0], [5, 0, 0], [120, 0, 0]], np.int32),
        np.array([9, 6, 2, 3]),
    )
    mine = shard.table(table)
    assert mine.table.tolist() == [[7, 50, 0], [20, 0, 0]] and mine.lens.tolist() == [6, 3]
    new = HeadBlocks(np.array([0, 1, 3, 3]), np.array([2, 2, 1, 2]), np.array([8, 160, 121, 122]))
    got = shard.blocks(new)
    assert got.lh.tolist() == [0, 1, 1] and got.index.tolist() == [2, 1, 2]
    assert got.ids.tolist() == [60, 21, 22]
    to, src = shard.copies(new, np.array([1, 101, 102, 103]))
    assert to.ids.tolist() == [60, 21, 22] and src.tolist() == [1, 2, 3]
    assert shard.block_pairs([(3, 4), (110, 111)]) == [(10, 11)]
    assert shard.swap_pairs([(5, 2), (130, 14)], device_first=True) == [(30, 4)]
    assert shard.swap_pairs([(2, 5), (14, 130)], device_first=False) == [(4, 30)]
    one = HeadShard(0, 1, num_layers=2, heads=2)
    assert one.table(table) is table and one.blocks(new) is new


def test_shard_gather_and_select_keep_the_global_head_order(monkeypatch):
    layers, heads, world = 2, 2, 2
    full = torch.arange(3 * layers * heads * world * 5).view(3, layers * heads * world, 5)
    shards = [HeadShard(r, world, layers, heads) for r in range(world)]
    parts = [s.select(full) for s in shards]  # each rank's heads [3, 4, 5]
    assert torch.equal(parts[1][:, 0], full[:, 2]) and torch.equal(parts[1][:, 3], full[:, 7])
    monkeypatch.setattr(shard_mod, "all_gather_stack", lambda x: torch.stack(parts))
    assert torch.equal(shards[0].gather(parts[0]), full)
    comp = torch.tensor([True, True, False, False])  # layer 0 compressible, layer 1 not
    assert shards[0].replicate(comp).tolist() == [True] * 4 + [False] * 4


@pytest.mark.parametrize(
    ("method", "floor"), [("kvcompress", 0.0), ("uniform", 0.0), ("kvcompress", 0.5)]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sharded_eviction_equals_one_rank(monkeypatch, method, floor, seed):
    """Each rank plans over its own heads, with the chunk costs and lengths of every rank's
    gathered: the union of the ranks' evictions is the one-rank eviction of all heads."""
    rng = np.random.default_rng(seed)
    layers, heads, world = 3, 2, 2  # 3 layers x 4 KV heads, 2 on each rank
    lh = layers * heads * world
    lens = rng.integers(1, 40, size=(3, lh))
    tables, lens_t, scores, positions, _ = _cache(lens, seed)
    comp = torch.tensor([True] * (heads * world) * 2 + [False] * (heads * world))
    budget = torch.from_numpy(rng.integers(0, int(lens.sum(1).min()), size=3))
    protect = torch.from_numpy(lens.max(1) - 3)
    width = int(lens.max())

    def plan(shard: HeadShard | None, idx: torch.Tensor) -> torch.Tensor:
        return plan_eviction(
            scores, positions, tables[:, idx], lens_t[:, idx], budget, protect, comp[idx],
            width, BS, 1, method, shard=shard, head_floor=floor,
        )[0]  # fmt: skip

    want = plan(None, torch.arange(lh))
    shards = [HeadShard(r, world, layers, heads) for r in range(world)]
    mine = [torch.from_numpy(np.flatnonzero(s.mine)) for s in shards]
    sent: list[torch.Tensor] = []
    # first each rank's contribution to the all-gather, then the plans from everyone's
    record = lambda x: sent.append(x) or torch.stack([x] * world)  # noqa: E731
    monkeypatch.setattr(shard_mod, "all_gather_stack", record)
    for s, idx in zip(shards, mine):
        plan(s, idx)
    gathered = torch.stack(sent)
    monkeypatch.setattr(shard_mod, "all_gather_stack", lambda x: gathered)
    got = torch.zeros_like(want)
    for s, idx in zip(shards, mine):
        got[:, idx] = plan(s, idx)
    assert torch.equal(got, want)
    assert int(want.sum()) > 0
