"""KV-Compress without a model: per-head tables, eviction against a brute-force reference,
protected tokens, compaction, and the block accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.core.kv_cache.head_paged import HeadPagedKVCacheManager
from pagedllm.core.kv_cache.spec import HeadPagedSpec
from pagedllm.core.request import Request
from pagedllm.core.sched.kvc import KVCReport
from pagedllm.kvcompress.evict import (
    compact,
    head_slots,
    maxpool_scores,
    move_bound,
    plan_eviction,
    stuck_bound,
    width_groups,
)
from pagedllm.sampling_params import SamplingParams

BS = 4
SPARE = 400 * BS  # the spare slot of `_cache` (its default 400 blocks + 1)


def _spec(layers: int = 3, heads: int = 2, compressible: tuple[bool, ...] | None = None):
    comp = compressible or (True,) * layers
    return HeadPagedSpec(BS, heads, 8, 4, num_layers=layers, compressible=comp)


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=8))


def test_per_head_tables_and_free():
    kv = HeadPagedKVCacheManager(_spec(), num_blocks=100)
    r = _req("a", 10)
    blocks = kv.allocate_slots(r, 10)
    assert blocks is not None
    # every (layer, head) gets cdiv(10, 4) = 3 blocks: 6 heads x 3, all distinct
    assert len(blocks) == 18 and len(set(blocks.ids.tolist())) == 18
    assert np.bincount(blocks.lh).tolist() == [3] * 6
    assert kv.num_free_blocks() == 82
    (table,) = kv.get_block_table("a")
    assert table.table.shape == (6, 3) and table.lens.tolist() == [0] * 6  # none computed yet
    r.num_computed_tokens = 10
    kv.check_integrity()
    # heads of different lengths need different numbers of new blocks
    kv.apply_compaction(r, np.array([10, 7, 4, 3, 9, 1]))
    assert kv.num_free_blocks() == 82 + 0 + 1 + 2 + 2 + 0 + 2
    kv.check_integrity()
    new = kv.allocate_slots(r, 2)  # lens -> [12, 9, 6, 5, 11, 3]
    assert sorted(new.lh.tolist()) == [1, 2, 3]
    kv.check_integrity()
    kv.free(r)
    kv.check_integrity()
    assert kv.is_idle_clean()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steps_after_an_eviction_take_a_block_only_where_a_head_is_full(seed):
    """After an eviction each head has its own length: a step of up to a block's tokens gives
    a new block to exactly the heads whose last block has fewer free slots than the step's
    tokens, at the next column of each, and the counts (blocks, room) stay exact - then all
    or nothing when the pool is short."""
    rng = np.random.default_rng(seed)
    kv = HeadPagedKVCacheManager(_spec(), num_blocks=200)
    r = _req("a", 30)
    kv.allocate_slots(r, 30)
    r.num_computed_tokens = 30
    kv.apply_compaction(r, rng.integers(1, 31, size=6))
    for _ in range(40):
        n = int(rng.integers(1, BS + 1))
        state = kv.states["a"]
        full = np.flatnonzero(state.nblocks * BS - state.lens < n)
        columns = state.nblocks[full].copy()
        new = kv.allocate_slots(r, n)
        assert new is not None
        assert sorted(new.lh.tolist()) == full.tolist()
        assert np.array_equal(new.index[np.argsort(new.lh)], columns)
        assert np.array_equal(state.table[new.lh, new.index], new.ids)
        r.num_computed_tokens += n
        kv.check_integrity()  # blocks == cdiv(lens) per head, room exact, ref counts
    kv.pool.take(kv.pool.num_free)  # nothing left: a step that needs a block changes nothing
    state = kv.states["a"]
    lens, room = state.lens.copy(), state.room
    assert kv.allocate_slots(r, room + 1) is None
    assert np.array_equal(state.lens, lens) and state.room == room


def test_allocation_all_or_nothing():
    kv = HeadPagedKVCacheManager(_spec(), num_blocks=10)
    assert kv.allocate_slots(_req("a", 8), 8) is None  # needs 6 x 2 = 12
    assert kv.num_free_blocks() == 10 and "a" not in kv.states
    assert kv.token_capacity() == (10 // 6) * BS


def test_fork_shares_then_copies_on_write():
    kv = HeadPagedKVCacheManager(_spec(layers=1), num_blocks=40)
    parent, child = _req("p", 6), _req("c", 6)
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    kv.check_integrity()
    assert kv.num_free_blocks() == 40 - 4  # shared
    kv.allocate_slots(child, 1)
    copies = kv.take_pending_copies()
    assert len(copies) == 4  # every shared block copied
    (rep,) = kv.take_replaced("c")
    assert sorted(rep.ids.tolist()) == sorted(d for _, d in copies)
    kv.check_integrity()
    assert kv.allocate_slots(parent, 1) is not None  # now alone: no copy
    assert kv.take_pending_copies() == []
    kv.free(parent)
    kv.free(child)
    assert kv.is_idle_clean()


# ---------------------------------------------------------------------- prefix caching


def _tok_req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def _start(kv: HeadPagedKVCacheManager, r: Request) -> int:
    """Admit a request as the scheduler does: its prefix hit, then its whole prompt."""
    hit, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hit) is not None
    r.num_computed_tokens = r.num_tokens
    return n


def test_prefix_hit_shares_every_heads_blocks_and_parks_them_when_free():
    kv = HeadPagedKVCacheManager(_spec(), num_blocks=100, enable_caching=True)
    base = list(range(3, 13))  # 10 tokens: 2 full blocks of 4
    a = _tok_req("a", base)
    assert _start(kv, a) == 0 and len(kv.cache) == 2  # its full blocks are registered
    b = _tok_req("b", base[:8] + [99, 98, 97])
    assert kv.can_allocate(b, 100)
    assert _start(kv, b) == 8
    ta, tb = kv.get_block_table("a")[0].table, kv.get_block_table("b")[0].table
    assert np.array_equal(ta[:, :2], tb[:, :2])  # the same 2 blocks in each of the 6 heads
    assert not np.intersect1d(ta[:, 2:], tb[:, 2:]).size
    assert kv.num_free_blocks() == 100 - 18 - 6  # b took one new block per head
    assert kv.prefix_tokens("b") == 8
    assert kv.held_kvs("b") == 11 * 6 - 8 * 6  # the budget counts what follows the prefix
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    # nobody holds the entries: parked, counted free, still hit
    assert len(kv.parked) == 2 and kv.is_idle_clean()
    c = _tok_req("c", base[:8] + [5])
    assert kv.num_cached_prefix_tokens(c) == 8
    # a request that needs every block takes the parked ones (the cache forgets them)
    d = _tok_req("d", list(range(500, 564)))  # 64 tokens: 16 blocks x 6 heads = 96
    assert kv.allocate_slots(d, 64) is not None
    assert not kv.parked and kv.num_free_blocks() == 4
    assert kv.num_cached_prefix_tokens(c) == 0 and len(kv.cache) == 16  # d's own blocks
    kv.check_integrity()


def test_settle_prefix_keeps_what_others_hold_and_uncaches_the_rest():
    kv = HeadPagedKVCacheManager(_spec(), num_blocks=200, enable_caching=True)
    base = list(range(3, 16))  # 13 tokens: 3 full blocks
    a = _tok_req("a", base)
    _start(kv, a)
    assert len(kv.cache) == 3
    b = _tok_req("b", base[:4] + [77] * 3)  # shares a's first block only
    assert _start(kv, b) == 4
    # before a's first eviction: block 0 is held by b too (protected); blocks 1-2 stay cached
    # until a's blocks are about to be rewritten, then leave
    assert kv.settle_prefix(a) == 4
    assert len(kv.cache) == 3 and kv.prefix_tokens("a") == 4
    assert kv.detach_own(a) is None
    assert len(kv.cache) == 1
    assert kv.held_kvs("a") == (13 - 4) * 6
    kv.check_integrity()
    # a is frozen: later steps register nothing; a new request hits the shared block only
    assert kv.allocate_slots(a, 4) is not None
    a.num_computed_tokens += 4
    assert len(kv.cache) == 1
    assert kv.num_cached_prefix_tokens(_tok_req("c", base + [1])) == 4
    # a request alone with its blocks: nothing protected, nothing left cached
    e = _tok_req("e", list(range(300, 312)))
    _start(kv, e)
    assert kv.settle_prefix(e) == 0 and kv.detach_own(e) is None and len(kv.cache) == 1
    for r in (a, b, e):
        kv.free(r)
    kv.check_integrity()
    assert kv.is_idle_clean() and len(kv.parked) == 1


def test_detach_own_keeps_the_entries_cached_through_copies():
    """A request alone with its cached prompt blocks, about to be evicted from: with room, it
    moves to copies and its entries stay cached (parked) for the next request."""
    kv = HeadPagedKVCacheManager(_spec(), num_blocks=60, enable_caching=True)
    base = list(range(3, 13))  # 10 tokens: 2 full blocks, 3 blocks a head
    a = _tok_req("a", base)
    _start(kv, a)
    old = kv.get_block_table("a")[0].table.copy()
    assert kv.settle_prefix(a) == 0
    copy = kv.detach_own(a, keep_cached=True)
    assert copy is not None
    blocks, src = copy
    new = kv.get_block_table("a")[0].table
    # heads x the 2 full blocks moved; the partial third block is a's alone and stays
    assert len(blocks) == 12 and np.array_equal(new[:, 2], old[:, 2])
    assert np.array_equal(src, old[blocks.lh, blocks.index])
    assert np.array_equal(blocks.ids, new[blocks.lh, blocks.index])
    assert not np.intersect1d(new[:, :2], old[:, :2]).size
    assert len(kv.parked) == 2 and kv.num_free_blocks() == 60 - 18  # parked count as free
    kv.check_integrity()
    assert kv.num_cached_prefix_tokens(_tok_req("b", base[:8] + [1, 2])) == 8
    # no room for copies: the entries leave the cache instead
    kv2 = HeadPagedKVCacheManager(_spec(), num_blocks=20, enable_caching=True)
    a2 = _tok_req("a", base)
    _start(kv2, a2)
    kv2.settle_prefix(a2)
    assert kv2.detach_own(a2, keep_cached=True) is None and not kv2.cache
    kv2.check_integrity()


def test_fork_copies_only_past_the_shared_prefix_and_swap_waits_for_sharers():
    kv = HeadPagedKVCacheManager(
        _spec(layers=1), num_blocks=60, num_host_blocks=60, enable_caching=True
    )
    base = list(range(3, 15))  # 12 tokens
    a = _tok_req("a", base)
    _start(kv, a)
    p = _tok_req("p", base[:8] + [50, 51, 52])
    assert _start(kv, p) == 8  # 2 shared blocks per head, 1 own
    child = _tok_req("c", list(p.all_token_ids))
    kv.fork(p, child)
    child.num_computed_tokens = p.num_computed_tokens
    kv.check_integrity()
    assert kv.allocate_slots(child, 1) is not None
    copies = kv.take_pending_copies()
    assert len(copies) == 2  # the own block of each of the 2 heads; the prefix stays shared
    assert kv.prefix_tokens("c") == 8
    kv.check_integrity()
    # swapping out a request that shares blocks would copy shared KVs: refused (recompute)
    assert kv.swap_out(p) is None
    kv.free(a)
    kv.free(child)
    pairs = kv.swap_out(p)  # alone now: swapped, its cached blocks stay cached (parked)
    assert pairs is not None and len(pairs) == 6
    assert len(kv.parked) == 3  # a's own third block, and the 2 p shared with a
    kv.check_integrity()
    p.swapped = True
    assert kv.swap_in(p) is not None
    kv.check_integrity()
    kv.free(p)
    assert kv.is_idle_clean()


def test_shared_prefix_is_neither_evicted_nor_moved():
    """Positions below a row's ``num_sinks`` (its shared cached prefix, logical 0..P-1 in
    every head) keep their slots' K, V, score and position through eviction and compaction."""
    rng = np.random.default_rng(3)
    lens = rng.integers(20, 40, size=(2, 4))
    tables, lens_t, scores, positions, kv = _cache(lens, 3)
    prefix = np.array([8, 12])
    slots0, _ = head_slots(tables, lens_t, int(lens.max()), BS)
    for i in range(2):  # the prefix in place: logical x holds position x; the rest shuffled
        for h in range(4):
            n = int(lens[i, h])
            p = int(prefix[i])
            order = np.concatenate([np.arange(p), p + rng.permutation(n - p)])
            positions[slots0[i, h, :n]] = torch.from_numpy(order).to(torch.int32)
    scores[:] = 0.0  # the prefix would be the cheapest to evict
    before = [kv.clone(), scores.clone(), positions.clone()]
    budget = torch.tensor([0, 0])
    evict, order, slots, valid = plan_eviction(
        scores, positions, tables, lens_t, budget, torch.from_numpy(lens.max(1)),
        torch.ones(4, dtype=torch.bool), int(lens.max()), BS, torch.from_numpy(prefix),
    )  # fmt: skip
    bound = sum(move_bound(int(lens[i].sum()), 0, BS, "kvcompress") for i in range(2))
    new_lens = compact(kv, scores, positions, evict, order, slots, valid, lens_t, bound, SPARE)
    for i in range(2):
        p = int(prefix[i])
        assert bool((new_lens[i] >= p).all()) and bool((evict[i] > 0).any())
        held = slots0[i, :, :p].reshape(-1)
        for got, was in zip((kv[:, held], scores[held], positions[held]), before):
            assert torch.equal(got, was[:, held] if was.dim() == 3 else was[held])


# --------------------------------------------------------------------------- eviction


def _cache(lens: np.ndarray, seed: int, num_blocks: int = 400, dim: int = 3):
    """Random per-head tables over a fresh cache: K/V, scores, and positions 0..len-1 in a
    shuffled logical order (as after earlier compactions)."""
    g = torch.Generator().manual_seed(seed)
    b, lh = lens.shape
    nb = -(-lens // BS)
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(b, lh, int(nb.max()), dtype=torch.int32)
    k = 0
    for i in range(b):
        for h in range(lh):
            tables[i, h, : nb[i, h]] = ids[k : k + nb[i, h]]
            k += nb[i, h]
    # one block more than the tables use: the spare slot (SPARE with the default num_blocks)
    scores = torch.rand((num_blocks + 1) * BS, generator=g)
    positions = torch.zeros((num_blocks + 1) * BS, dtype=torch.int32)
    kv = torch.randn(2, (num_blocks + 1) * BS, dim, generator=g)
    lens_t = torch.from_numpy(lens)
    slots, valid = head_slots(tables, lens_t, int(lens.max()), BS)
    for i in range(b):
        for h in range(lh):
            n = int(lens[i, h])
            positions[slots[i, h, :n]] = torch.randperm(n, generator=g).to(torch.int32)
    return tables, lens_t, scores, positions, kv


def _brute_force(scores, positions, tables, lens, budget, protect_from, sinks, compressible):
    """Per sequence: list every chunk (head, j) with its cost and size, take the cheapest
    (ties by head then j) while the sequence holds more than its budget."""
    out = np.zeros(lens.shape, dtype=np.int64)
    for i in range(lens.shape[0]):
        chunks = []
        for h in range(lens.shape[1]):
            n = int(lens[i, h])
            if n == 0:
                continue
            slots = [int(tables[i, h, x // BS]) * BS + x % BS for x in range(n)]
            keys = sorted(
                (
                    float(scores[s])
                    if compressible[h] and sinks <= positions[s] < protect_from[i]
                    else float("inf")
                )
                for s in slots
            )
            hanging = n - (-(-n // BS) - 1) * BS
            for j in range(-(-n // BS)):
                removed = hanging + j * BS
                size = hanging if j == 0 else BS
                chunks.append((keys[removed - 1], h, j, size))
        held = int((lens[i] * compressible).sum())
        for cost, h, _, size in sorted(chunks):
            if held <= budget[i] or cost == float("inf"):
                break
            out[i, h] += size
            held -= size
    return out


@pytest.mark.parametrize("seed", range(6))
def test_eviction_frees_the_cheapest_blocks(seed):
    rng = np.random.default_rng(seed)
    b, lh = 3, 6
    lens = rng.integers(0, 30, size=(b, lh))
    lens[0, 0] = 29
    tables, lens_t, scores, positions, _ = _cache(lens, seed)
    compressible = np.array([True, True, True, True, False, False])
    budget = rng.integers(0, int(lens.sum(1).max()), size=b)
    seq_len = lens.max(1)
    protect_from = seq_len - rng.integers(0, 6, size=b)
    sinks = int(rng.integers(0, 3))
    evict, order, slots, valid = plan_eviction(
        scores,
        positions,
        tables,
        lens_t,
        torch.from_numpy(budget),
        torch.from_numpy(protect_from),
        torch.from_numpy(compressible),
        int(lens.max()),
        BS,
        sinks,
    )
    ref = _brute_force(scores, positions, tables, lens, budget, protect_from, sinks, compressible)
    assert evict.numpy().tolist() == ref.tolist()
    # every head keeps whole blocks' worth of cuts: it frees exactly cdiv(len)-cdiv(len-e)
    # blocks and evicts the e lowest-scoring evictable KVs
    new_lens = lens - ref
    for i in range(b):
        for h in range(lh):
            e = int(ref[i, h])
            if e == 0:
                continue
            n = int(lens[i, h])
            assert (n - e) % BS == 0  # a head gives up its hanging block, then whole ones
            gone = slots[i, h, order[i, h, :e]]
            kept = slots[i, h, order[i, h, e:n]]
            evictable = (positions[kept] < protect_from[i]) & (positions[kept] >= sinks)
            if bool(evictable.any()):
                assert scores[gone].max() <= scores[kept][evictable].min()
            assert (-(-n // BS)) - (-(-new_lens[i, h] // BS)) >= 1


def test_protected_window_and_sinks_survive_and_compaction_keeps_everything():
    rng = np.random.default_rng(7)
    lens = rng.integers(5, 40, size=(2, 4))
    tables, lens_t, scores, positions, kv = _cache(lens, 7)
    seq_len = lens.max(1)
    protect_from = seq_len - 6
    before = {}
    slots0, _ = head_slots(tables, lens_t, int(lens.max()), BS)
    for i in range(2):
        for h in range(4):
            for x in range(int(lens[i, h])):
                s = int(slots0[i, h, x])
                before[(i, h, int(positions[s]))] = (kv[:, s].clone(), float(scores[s]))
    evict, order, slots, valid = plan_eviction(
        scores,
        positions,
        tables,
        lens_t,
        torch.tensor([10, 0]),
        torch.from_numpy(protect_from),
        torch.ones(4, dtype=torch.bool),
        int(lens.max()),
        BS,
        num_sinks=2,
    )
    bound = sum(move_bound(int(lens[i].sum()), b, BS, "kvcompress") for i, b in enumerate([10, 0]))
    new_lens = compact(kv, scores, positions, evict, order, slots, valid, lens_t, bound, SPARE)
    assert torch.equal(new_lens, lens_t - evict)
    after_slots, _ = head_slots(tables, new_lens, int(lens.max()), BS)
    for i in range(2):
        for h in range(4):
            n_new = int(new_lens[i, h])
            got = {int(positions[int(after_slots[i, h, x])]) for x in range(n_new)}
            assert len(got) == n_new  # no duplicate, no hole
            n = int(lens[i, h])
            protected = {p for p in range(n) if p >= protect_from[i] or p < 2}
            assert protected <= got  # the window and the sinks are never evicted
            for x in range(n_new):  # every survivor's K, V and score moved with it
                s = int(after_slots[i, h, x])
                k_v, sc = before[(i, h, int(positions[s]))]
                assert torch.equal(kv[:, s], k_v) and float(scores[s]) == sc
            # the evicted ones are the cheapest evictable ones of the head
            gone = {p for p in range(n)} - got
            if gone:
                worst_gone = max(before[(i, h, p)][1] for p in gone)
                kept_evictable = [before[(i, h, p)][1] for p in got - protected]
                assert not kept_evictable or worst_gone <= min(kept_evictable)


@pytest.mark.parametrize("method", ["kvcompress", "random", "uniform"])
@pytest.mark.parametrize("seed", range(4))
def test_compaction_moves_within_the_host_bound(method, seed):
    """The device compaction has a move list sized by ``move_bound`` from host numbers alone
    (no sync); a bound too small would drop moves (``compact`` checks it on the CPU). The
    result equals a compaction with room for every KV."""
    rng = np.random.default_rng(100 + seed)
    lens = rng.integers(1, 60, size=(3, 6))
    budgets = rng.integers(0, 200, size=3)
    held = lens.sum(1)
    results = []
    for room in ("bound", "all"):
        tables, lens_t, scores, positions, kv = _cache(lens, seed)
        evict, order, slots, valid = plan_eviction(
            scores,
            positions,
            tables,
            lens_t,
            torch.from_numpy(budgets),
            torch.full((3,), 10**9),
            torch.ones(6, dtype=torch.bool),
            int(lens.max()),
            BS,
            method=method,
            generator=torch.Generator().manual_seed(seed),
        )
        if room == "bound":
            n = sum(move_bound(int(h), int(b), BS, method) for h, b in zip(held, budgets))
        else:
            n = int(lens.sum())
        new_lens = compact(kv, scores, positions, evict, order, slots, valid, lens_t, n, SPARE)
        after, ok = head_slots(tables, new_lens, int(lens.max()), BS)
        results.append((new_lens, kv[:, after[ok]], scores[after[ok]], positions[after[ok]]))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["kvcompress", "random"])
def test_moves_within_the_bound_of_what_survives(method):
    """``move_bound`` with ``stuck`` (the heads' unevictable KVs plus a block each) sizes the
    move list by what can survive, not by what is evicted: over random lengths, budgets
    (0 included), protected windows and sinks, with each head holding a random subset of the
    computed positions, compaction never moves more (``compact`` checks on the CPU) and
    equals a compaction with room for every KV. The bound is below the old one somewhere."""
    rng = np.random.default_rng(11)
    b, lh = 3, 6
    tighter = 0
    for trial in range(40):
        computed = rng.integers(8, 70, size=b)
        lens = np.minimum(rng.integers(1, 70, size=(b, lh)), computed[:, None])
        budgets = rng.choice([0, 5, 30, 120], size=b)
        protect = computed - rng.integers(0, 12, size=b)
        sinks = rng.integers(0, 4, size=b)
        picks = [[rng.permutation(int(c))[:n] for n in row] for c, row in zip(computed, lens)]
        bound = 0
        for i in range(b):
            held, budget = int(lens[i].sum()), int(budgets[i])
            stuck = stuck_bound(lh, int(computed[i]), int(protect[i]), int(sinks[i]), BS)
            bound += move_bound(held, budget, BS, method, stuck)
            tighter += move_bound(held, budget, BS, method, stuck) < move_bound(
                held, budget, BS, method
            )
        results = []
        for n in (bound, int(lens.sum())):
            tables, lens_t, scores, positions, kv = _cache(lens, trial)
            slots, _ = head_slots(tables, lens_t, int(lens.max()), BS)
            for i in range(b):  # positions: a random subset of the computed ones
                for h in range(lh):
                    pos = torch.from_numpy(picks[i][h]).to(torch.int32)
                    positions[slots[i, h, : lens[i, h]]] = pos
            evict, order, slots, valid = plan_eviction(
                scores, positions, tables, lens_t, torch.from_numpy(budgets),
                torch.from_numpy(protect), torch.ones(lh, dtype=torch.bool), int(lens.max()), BS,
                torch.from_numpy(sinks), method, torch.Generator().manual_seed(trial),
            )  # fmt: skip
            new_lens = compact(kv, scores, positions, evict, order, slots, valid, lens_t, n, SPARE)
            after, ok = head_slots(tables, new_lens, int(lens.max()), BS)
            results.append((new_lens, kv[:, after[ok]], scores[after[ok]], positions[after[ok]]))
        for x, y in zip(*results):
            assert torch.equal(x, y)
    assert tighter > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(3))
def test_eviction_and_compaction_on_cuda_match_the_cpu(seed):
    """The same eviction plan and compaction on the GPU and on the CPU: equal new lengths,
    and the same K/V, scores and positions at every surviving logical index."""
    rng = np.random.default_rng(300 + seed)
    lens = rng.integers(1, 80, size=(4, 8))
    budgets = torch.from_numpy(rng.integers(0, 300, size=4))
    protect = torch.from_numpy(lens.max(1) - 8)
    held = lens.sum(1)
    bound = sum(move_bound(int(h), int(b), BS, "kvcompress") for h, b in zip(held, budgets))
    results = []
    for dev in ("cpu", "cuda"):
        t = [x.to(dev) for x in _cache(lens, seed)]
        tables, lens_t, scores, positions, kv = t
        evict, order, slots, valid = plan_eviction(
            scores, positions, tables, lens_t, budgets.to(dev), protect.to(dev),
            torch.ones(8, dtype=torch.bool, device=dev), int(lens.max()), BS, num_sinks=2,
        )  # fmt: skip
        new_lens = compact(kv, scores, positions, evict, order, slots, valid, lens_t, bound,
                           SPARE)  # fmt: skip
        after, ok = head_slots(tables, new_lens, int(lens.max()), BS)
        results.append([x.cpu() for x in (new_lens, kv[:, after[ok]], scores[after[ok]],
                                          positions[after[ok]])])  # fmt: skip
    assert int((results[0][0] < torch.from_numpy(lens)).sum()) > 0  # something was evicted
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_width_groups():
    assert width_groups([6000, 300, 5000, 900, 250]) == [[0, 2], [3, 1, 4]]
    assert width_groups([6000, 300, 5000, 900, 200]) == [[0, 2], [3, 1], [4]]
    assert width_groups([100, 100, 30]) == [[0, 1, 2]]
    assert width_groups([]) == []


def test_evicting_in_width_groups_equals_one_call():
    """The runner evicts requests of very different lengths in separate calls, each with its
    own sort width and move bound (``width_groups``): the same lengths, K/V, scores and
    positions as one call over all of them (an eviction of a request depends on nobody
    else's KVs, nor on the padding)."""
    rng = np.random.default_rng(7)
    lens = np.concatenate([rng.integers(60, 90, size=(2, 6)), rng.integers(1, 12, size=(3, 6))])
    budgets = torch.tensor([100, 40, 10, 5, 20])
    protect = torch.from_numpy(lens.max(1) - 4)
    comp = torch.ones(6, dtype=torch.bool)

    def evict(rows: list[int], state):
        tables, lens_t, scores, positions, kv = state
        idx = torch.tensor(rows)
        width = int(lens[rows].max())
        bound = sum(move_bound(int(lens[i].sum()), int(budgets[i]), BS, "kvcompress") for i in rows)
        plan = plan_eviction(
            scores, positions, tables[idx], lens_t[idx], budgets[idx], protect[idx], comp,
            width, BS, num_sinks=1,
        )  # fmt: skip
        return compact(kv, scores, positions, *plan, lens_t[idx], bound, SPARE)

    one = _cache(lens, 5)
    new_one = evict(list(range(5)), one)
    groups = _cache(lens, 5)
    parts = width_groups([int(x) for x in lens.max(1)])
    assert len(parts) == 2
    new_groups = torch.zeros_like(new_one)
    for part in parts:
        new_groups[part] = evict(part, groups)
    assert torch.equal(new_one, new_groups)
    assert int((new_one < torch.from_numpy(lens)).sum()) > 0
    for a, b in zip(one[2:], groups[2:]):  # scores, positions, K/V: the whole cache
        assert torch.equal(a, b)


def test_uniform_splits_the_budget_evenly():
    lens = np.array([[40, 12, 33, 20]])
    tables, lens_t, scores, positions, _ = _cache(lens, 3)
    evict, *_ = plan_eviction(
        scores,
        positions,
        tables,
        lens_t,
        torch.tensor([64]),
        torch.tensor([1000]),
        torch.ones(4, dtype=torch.bool),
        40,
        BS,
        method="uniform",
    )
    new = (lens_t - evict).numpy()[0]
    # 16 per head, cut at block granularity: a head over 16 keeps at most 16, at least 13
    assert new.tolist()[1] == 12
    for n in new[[0, 2, 3]]:
        assert 13 <= n <= 16


@pytest.mark.parametrize("seed", range(4))
def test_head_floor_keeps_each_head_a_share_of_the_budget(seed):
    """kvc_head_floor: a head whose KVs all score below the others' still keeps its floor
    (``head_floor`` x an even share of the evictable budget, within a block), the budget is
    still met, and without a floor that head is emptied down to its protected KVs."""
    lens = np.array([[40, 40, 40, 40]])
    tables, lens_t, scores, positions, _ = _cache(lens, seed)
    slots, valid = head_slots(tables, lens_t, 40, BS)
    scores[slots[0, 0]] *= 1e-3  # head 0: every KV cheaper than any other head's
    budget, protect = 64, 36  # 4 protected KVs a head; even share 16, 12 of them evictable

    def kept(floor: float) -> list[int]:
        evict, *_ = plan_eviction(
            scores, positions, tables, lens_t, torch.tensor([budget]), torch.tensor([protect]),
            torch.ones(4, dtype=torch.bool), 40, BS, head_floor=floor,
        )  # fmt: skip
        return (lens_t - evict)[0].tolist()

    assert kept(0.0)[0] == 4  # only its protected window
    for floor in (0.5, 1.0):
        new = kept(floor)
        assert sum(new) <= budget
        least = 4 + floor * 12 - (BS - 1)  # the floor, less at most a block
        assert min(new) >= least, (floor, new)
    assert kept(1.0) == [16, 16, 16, 16]  # a full floor is the even split


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "half"])
def test_a_head_floor_outside_zero_to_one_is_refused_by_name(bad):
    from pagedllm.config import KVCompressConfig

    with pytest.raises(ValueError, match="kvc_head_floor must be a number in"):
        KVCompressConfig(head_floor=bad)


def test_maxpool_over_valid_entries():
    metric = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0]])
    valid = torch.tensor([[True] * 8 + [False]])
    out = maxpool_scores(metric, valid, 3)
    assert out[0, :8].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]


def _step_md(n_sched: np.ndarray, seq_lens: np.ndarray):
    from pagedllm.attention.metadata import AttentionMetadata

    qsl = np.concatenate([[0], np.cumsum(n_sched)])
    t = torch.zeros(1)
    return AttentionMetadata(
        num_reqs=len(n_sched), num_actual_tokens=int(qsl[-1]), query_start_loc=t,
        seq_lens=t, slot_mapping=t, block_tables=t, max_query_len=int(n_sched.max()),
        max_seq_len=int(seq_lens.max()), block_size=BS, query_start_loc_np=qsl,
        seq_lens_np=seq_lens,
    )  # fmt: skip


def _runner_cache(reqs: list, scored: tuple[bool, ...] | None = None):
    """A manager and the runner's cache on the CPU (3 layers of _spec()), request i in row i
    with its prompt's blocks (``scored[i]``: whether its keys are scored), and a function
    that prepares a step of (rows, tokens each) and returns its metadata."""
    from pagedllm.config import KVCompressConfig
    from pagedllm.core.kv_cache.head_paged import HeadTable
    from pagedllm.kvcompress.cache import HeadPagedCache

    spec = _spec()
    kv = HeadPagedKVCacheManager(spec, num_blocks=200)
    cfg = KVCompressConfig(enabled=True)
    cache = HeadPagedCache(spec, cfg, torch.float32, torch.device("cpu"), 4, 64, [None] * 3)
    cache.allocate(200)
    lh = spec.num_heads_total
    for row, r in enumerate(reqs):
        kv.allocate_slots(r, r.num_tokens)
        head = kv.get_block_table(r.request_id)[0]
        cache.set_row(
            row, HeadTable(head.table, np.zeros(lh)), True if scored is None else scored[row]
        )

    def step(rows, n):
        rows, n = np.asarray(rows), np.asarray(n)
        md = _step_md(n, np.full(len(rows), 64))
        pos = torch.arange(int(n.sum()))
        cache.prepare_step(md, rows, n, pos, np.zeros(len(rows), dtype=bool))
        return md

    return kv, cache, lh, step


def test_steps_without_a_scored_row_build_no_score_pass():
    """A step's layers are compressible (their kernels add scores) when any of its rows is
    scored, and read as not compressible when none is (no budget: never evicted)."""
    reqs = [_req("a", 6), _req("b", 3)]
    _, cache, _, step = _runner_cache(reqs, scored=(True, False))
    for rows, scoring in (([0, 1], True), ([1], False), ([0], True)):
        md = step(rows, [1] * len(rows))
        cache.finish_metadata(md)
        assert [m.kvc.compressible for m in md.groups] == [scoring] * 3, rows


def test_runner_tables_follow_the_manager_through_deferred_entries():
    """The runner's cache mirrors the manager's tables from each step's new entries, which
    reach the device with the next step's slot computation (or at once, before a row is set
    anew): every step's slots are those the manager's tables give, through block boundaries
    (uniform and after an eviction) and a row given to another request."""
    from pagedllm.core.kv_cache.head_paged import HeadTable

    reqs = [_req("a", 6), _req("b", 3)]
    kv, cache, lh, prepare = _runner_cache(reqs)

    def step(rows, n):
        return prepare(rows, n).plan["kvc"][0]

    def expected(r, offsets):  # [len(offsets), LH] slots from the manager's table
        state = kv.states[r.request_id]
        idx = state.lens[None, :] - state.pending + np.asarray(offsets)[:, None]
        blk = state.table[np.arange(lh)[None, :], idx // BS]
        return blk * BS + idx % BS

    slots = step([0, 1], [6, 3])
    assert np.array_equal(slots[:6].numpy(), expected(reqs[0], range(6)))
    for r in reqs:
        r.num_computed_tokens = r.num_tokens
    # an eviction: request a keeps [4, 5, 2, ...] KVs per head (its heads differ from now on)
    new = np.array([4, 5, 2, 6, 3, 1])
    kv.apply_compaction(reqs[0], new)
    cache.lens[0] = torch.from_numpy(new)
    for i in range(7):  # decodes: blocks at 4 and 8 tokens (b), and per head after a's eviction
        entries = []
        for r in reqs:
            r.append_output_token_ids([9])
            entries.append(kv.allocate_slots(r, 1))
            r.num_computed_tokens += 1
        cache.set_entries([0, 1], entries)
        slots = step([0, 1], [1, 1]).numpy()
        for j, r in enumerate(reqs):
            assert np.array_equal(slots[j : j + 1], expected(r, [0])), (i, r.request_id)
    # entries set for both rows, then the row of b given to a new request c before any step
    # (as after a failed step): b's entries land before c's table, which replaces them
    entries = []
    for r, n in ((reqs[0], 1), (reqs[1], 3)):  # b: 10 -> 13 tokens, a new block at index 3
        r.append_output_token_ids([9] * n)
        entries.append(kv.allocate_slots(r, n))
    assert len(entries[1]) == lh
    cache.set_entries([0, 1], entries)
    c = _req("c", 16)  # (its blocks 0-3: b's entries at index 3 would break its last 4 slots)
    kv.allocate_slots(c, 16)
    kv.free(reqs[1])
    cache.set_row(1, HeadTable(kv.get_block_table("c")[0].table, np.zeros(lh)))
    slots = step([0, 1], [1, 16]).numpy()
    assert np.array_equal(slots[:1], expected(reqs[0], [0]))
    assert np.array_equal(slots[1:], expected(c, range(16)))
    kv.check_integrity()


def _kvc_scheduler(num_blocks: int, max_num_batched_tokens: int = 256):
    """A scheduler with KV-Compress on the ``_spec`` shape (3 layers x 2 KV heads, bs 4)."""
    from pagedllm.config import CacheConfig, KVCompressConfig, SchedulerConfig
    from pagedllm.core.kv_cache.spec import KVCacheGroup, KVCacheGroups
    from pagedllm.core.sched.scheduler import Scheduler

    spec = _spec()
    groups = KVCacheGroups((KVCacheGroup(spec, (0, 1, 2)),), 1, (spec,))
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8, max_model_len=256
        ),
        CacheConfig(block_size=BS),
        num_blocks,
        kv_groups=groups,
        kvc_config=KVCompressConfig(enabled=True, compress_once=True),
    )


def _evictions(so):
    """The KV-Compress evictions a step plans (its planner's metadata)."""
    meta = so.kv_connector_metadata.get("kvcompress")
    return meta.evictions if meta is not None else []


def _make_room(sched, room: dict, short: int) -> bool:
    """The planner's make-room rule with ``room`` as the step's marked requests."""
    planner = sched.connectors[0]
    planner._room = room
    return planner._mark_for_room({}, short)


def test_make_room_takes_the_requests_grown_by_a_block_first():
    """Memory short: the requests over their budget grown by at least a block's tokens since
    their last eviction are marked (all of them), the others only when those cannot free
    enough; evictions still in flight count (nothing needs marking when they free enough);
    False when even everything cannot."""
    from pagedllm.core.sched.output import ModelRunnerOutput

    sched = _kvc_scheduler(400)
    sp = SamplingParams(max_tokens=50, ignore_eos=True, max_cache_tokens=4)
    for i, rid in enumerate("abc"):
        sched.add_request(Request(rid, list(range(3 + 30 * i, 23 + 30 * i)), sp, eos_token_id=2))
    so = sched.schedule()  # the prompts (20 tokens), an eviction planned after each
    assert {e.req_id for e in _evictions(so)} == set("abc")
    keep = KVCReport({rid: np.full(6, 4) for rid in "abc"})  # 4 KVs a head: 24, the budget
    sched.update_from_output(
        so, ModelRunnerOutput(list("abc"), [[7]] * 3, kv_connector_output={"kvcompress": keep})
    )
    assert not sched.connectors[0].inflight
    # each request holds 24 KVs + 6 a decode token; last evicted 20, 2 and 12 tokens ago
    for rid, growth in zip("abc", (20, 2, 12)):
        r = sched.requests[rid]
        sched.kv_cache_manager.allocate_slots(r, growth)
        r.append_output_token_ids([7] * growth)
        r.num_computed_tokens += growth
        sched.connectors[0].tracks[rid].compressed_at = r.num_computed_tokens - growth
    # over by 6 x growth KVs: a frees 30 blocks, b 3, c 18 (ceil(over / 4))
    room: dict[str, int] = {}
    assert _make_room(sched, room, 10)
    assert set(room) == {"a", "c"}  # both grew by a block (4 tokens) or more; b did not
    room = {}
    assert _make_room(sched, room, 50)
    assert set(room) == {"a", "b", "c"}  # 48 from a and c are short of 50: b too
    assert not _make_room(sched, {}, 52)  # 51 at most: preempt instead
    sched.connectors[0].inflight["x"] = [1, 60]  # an eviction in flight frees 60 blocks
    room = {}
    assert _make_room(sched, room, 52)
    assert _make_room(sched, room, 0) and set(room) == {"a", "c"}
    sched.connectors[0].inflight["a"] = [
        1,
        0,
    ]  # a's eviction in flight: its old lengths not counted
    room = {}
    assert _make_room(sched, room, 78) and set(room) == {"c"}  # 60 + 18
    room = {}
    assert _make_room(sched, room, 80) and set(room) == {"b", "c"}
    assert not _make_room(sched, {}, 82)


def test_next_step_waits_for_evictions_that_free_what_it_wants():
    """Under async scheduling a step is planned before the last step's evictions come back.
    When memory stopped the last plan and the pool has less free than it wanted, the next
    step takes those evictions first (``wants_results_first``): a long prompt is admitted
    in the step after the eviction of the one before it, not a step later. Not while nothing
    is in flight, nor when the pool already has what the next step wants."""
    from pagedllm.core.sched.output import ModelRunnerOutput

    sched = _kvc_scheduler(100)  # 6 (layer, head) pairs, bs 4
    kvm = sched.kv_cache_manager
    sp = SamplingParams(max_tokens=8, ignore_eos=True, max_cache_tokens=4)
    for rid, start in (("a", 3), ("b", 100)):  # 40 tokens: 10 blocks a head, 60 in all
        sched.add_request(Request(rid, list(range(start, start + 40)), sp, eos_token_id=2))
    assert not sched.wants_results_first()  # nothing planned yet
    so = sched.schedule()  # a, then b short of 20 blocks: memory stops the plan
    assert list(so.num_scheduled_tokens) == ["a"] and _evictions(so)
    assert kvm.num_free_blocks() == 40
    assert sched.wants_results_first()  # it wanted 60 + 60 and a's eviction is in flight
    keep = KVCReport({"a": np.full(6, 4)})  # a keeps 4 KVs a head: 9 blocks of 10 go
    sched.update_from_output(
        so, ModelRunnerOutput(["a"], [[7]], kv_connector_output={"kvcompress": keep})
    )
    assert not sched.wants_results_first()  # landed: nothing in flight
    so = sched.schedule()  # a decodes, b is admitted with the blocks a's eviction freed
    assert so.num_scheduled_tokens == {"a": 1, "b": 40}
    # b's eviction in flight; its prompt done, no prompt tokens left: the next step wants
    # nothing it lacks
    assert _evictions(so) and not sched.wants_results_first()
    sched.add_request(Request("c", list(range(200, 260)), sp, eos_token_id=2))
    assert not sched.wants_results_first()  # (the plan before c came)
    so2 = sched.schedule()  # c's 60 tokens need 90 blocks with b's 60 still held
    assert "c" not in so2.num_scheduled_tokens and sched.wants_results_first()
    # as if the pool had what the next step wants: free >= wanted -> False
    sched.connectors[0].wanted = kvm.num_free_blocks()
    assert not sched.wants_results_first()


@pytest.mark.parametrize("third", [False, True])
def test_next_step_waits_for_evictions_when_its_prompt_chunk_does_not_fit(third):
    """The token budget, not memory, stopped the last plan: the next step wants the blocks
    of the prompt tokens left (the rest of the prompt it cut, then the first waiting
    request's, up to the budget) and takes the evictions in flight first only when the pool
    has fewer free."""
    sched = _kvc_scheduler(130, max_num_batched_tokens=48)  # 6 (layer, head) pairs, bs 4
    kvm = sched.kv_cache_manager
    sp = SamplingParams(max_tokens=8, ignore_eos=True, max_cache_tokens=4)
    for rid, start in (("a", 3), ("b", 100), ("c", 200))[: 2 + third]:
        sched.add_request(Request(rid, list(range(start, start + 40)), sp, eos_token_id=2))
    so = sched.schedule()  # a's 40 tokens (60 blocks), b's first 8 (12): the budget stops it
    assert so.num_scheduled_tokens == {"a": 40, "b": 8} and _evictions(so)
    assert kvm.num_free_blocks() == 58
    # b's 32 tokens left (48 blocks) fit; with c waiting the next step takes 48 tokens: 72
    assert sched.wants_results_first() == third


def test_next_step_waits_for_the_evictions_that_make_room_for_decodes():
    """Memory stops decodes (their requests need a block, the pool has none left):
    ``make_room`` plans evictions and those requests wait for them; the next step takes
    their lengths first rather than find the pool as empty."""
    from pagedllm.core.sched.output import ModelRunnerOutput

    sched = _kvc_scheduler(60)  # 6 (layer, head) pairs, bs 4: 10 blocks a head
    sp = SamplingParams(max_tokens=20, ignore_eos=True, max_cache_tokens=4, compress_once=True)
    for rid, start in (("a", 3), ("b", 100), ("c", 200)):  # 20 tokens: 5 blocks a head
        sched.add_request(Request(rid, list(range(start, start + 20)), sp, eos_token_id=2))
    for _ in range(20):
        so = sched.schedule()
        ids = list(so.num_scheduled_tokens)
        if _evictions(so) and not sched.waiting and max(so.num_scheduled_tokens.values()) == 1:
            break  # evictions in a decode-only step: memory was short
        lens = KVCReport({e.req_id: np.full(6, 4) for e in _evictions(so)})  # 4 KVs a head
        sched.update_from_output(
            so, ModelRunnerOutput(ids, [[7]] * len(ids), kv_connector_output={"kvcompress": lens})
        )
        assert not sched.wants_results_first()  # nothing in flight
    else:
        raise AssertionError("memory never ran short")
    assert len(ids) < 3  # some requests wait for the evictions
    assert sched.wants_results_first()
