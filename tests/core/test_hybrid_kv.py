"""Layer grouping and the hybrid KV manager with no model: exact block ids, what leaves the
window, prefix hits across groups, fork, swap and integrity."""

from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache.factory import make_kv_cache_manager
from pagedllm.core.kv_cache.hybrid import HybridKVCacheManager
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec, group_layers
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import fake_run

BS = 4
FULL = FullAttentionSpec(BS, 1, 8, 4)
SW6 = SlidingWindowSpec(BS, 1, 8, 4, sliding_window=6)


def req(rid: str, n: int, start: int = 100) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=50))


def hybrid(num_blocks: int = 40, caching: bool = True, host: int = 0) -> HybridKVCacheManager:
    groups = group_layers([SW6, FULL])  # one sliding layer, one full: 2 groups of 1 layer
    kv = make_kv_cache_manager(groups, num_blocks, BS, caching, host, max_num_batched_tokens=8)
    assert isinstance(kv, HybridKVCacheManager)
    return kv


def test_group_layers_gemma3_270m_shape():
    sw = SlidingWindowSpec(16, 1, 256, 2, sliding_window=512)
    full = FullAttentionSpec(16, 1, 256, 2)
    specs = [full if i % 6 == 5 else sw for i in range(18)]
    groups = group_layers(specs)
    assert groups.layers_per_group == 3
    assert [g.layer_ids for g in groups.groups] == [
        (5, 11, 17),
        (0, 1, 2),
        (3, 4, 6),
        (7, 8, 9),
        (10, 12, 13),
        (14, 15, 16),
    ]
    assert groups.block_bytes == 3 * full.page_bytes
    where = groups.layer_position()
    assert where[11] == (0, 1) and where[6] == (2, 2)
    # hybrid off: one full-attention group, one tensor per layer, as a model without windows
    off = group_layers(specs, hybrid=False)
    assert off.num_groups == 1 and not off.is_hybrid and off.layers_per_group == 18
    assert isinstance(make_kv_cache_manager(off, 10, 16, True), KVCacheManager)


def test_sliding_group_frees_blocks_that_leave_the_window():
    kv = hybrid()
    r = req("a", 13)
    new = kv.allocate_slots(r, 13)
    assert kv.new_block_ids(new) == ([1, 2, 3, 4], [5, 6, 7, 8])  # block 0 is the null block
    r.num_computed_tokens = 13
    r.append_output_token_ids(7)
    # the next query (position 13) sees keys 8..13: the window group drops blocks 0 and 1
    assert kv.new_block_ids(kv.allocate_slots(r, 1)) == ()  # nothing new anywhere
    assert kv.get_block_table("a") == ([1, 2, 3, 4], [0, 0, 7, 8])
    kv.check_integrity()
    assert kv.num_free_blocks() == 40 - 1 - 8 + 2
    # the freed blocks were cached (full, prefix caching on): still findable, at the back
    pool = kv.block_pool
    assert [b.block_id for b in list(pool.free_block_queue)[-2:]] == [5, 6]
    r.status = RequestStatus.FINISHED_STOPPED
    kv.free(r)
    kv.check_integrity()
    assert kv.is_idle_clean()


def test_prefix_hit_needs_every_group():
    kv = hybrid()
    a = req("a", 21)
    kv.allocate_slots(a, 21)
    a.num_computed_tokens = 21
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    b = req("b", 22)  # same 21 tokens + 1
    tables, hit = kv.get_computed_blocks(b)
    assert hit == 20  # 5 full blocks; the window group has blocks 3, 4 (keys 14..19)
    assert [blk.block_id for blk in tables[0]] == [1, 2, 3, 4, 5]
    assert [blk.block_id for blk in tables[1]] == [0, 0, 0, 10, 11]  # null: outside the window
    # evict window block 3 of the sliding group: a hit at 20 is gone, 16 needs blocks 2, 3 ->
    # gone too; 12 needs 1, 2 -> still there
    sw_block = tables[1][3]
    kv.block_pool.free_block_queue.remove(sw_block)
    kv.block_pool._evict(sw_block)
    kv.block_pool.free_block_queue.appendleft(sw_block)
    assert kv.num_cached_prefix_tokens(b) == 12
    tables, hit = kv.get_computed_blocks(b)
    assert hit == 12 and len(tables[0]) == len(tables[1]) == 3
    assert kv.allocate_slots(b, 10, tables) is not None
    kv.check_integrity()


def test_fork_copy_on_write_and_swap_round_trip():
    kv = hybrid(host=20)
    p = req("p", 14)
    kv.allocate_slots(p, 14)
    p.num_computed_tokens = 14
    c = req("c", 14)
    c.num_computed_tokens = 14
    kv.fork(p, c)
    assert kv.get_block_table("c") == kv.get_block_table("p")
    # c writes position 14 (shared partial block 3 in both groups): two private copies
    c.append_output_token_ids(1)
    assert kv.allocate_slots(c, 1) is not None
    replaced = kv.take_replaced("c")
    assert sorted(g for g, _, _ in replaced) == [0, 1]
    assert len(kv.take_pending_copies()) == 2
    kv.check_integrity()
    live = sum(1 for t in kv.get_block_table("c") for b in t if b != 0)
    pairs = kv.swap_out(c)
    assert pairs is not None and len(pairs) == live
    c.swapped = True
    kv.check_integrity()
    assert kv.can_allocate(c, 8)
    back = kv.swap_in(c)
    assert back is not None and len(back) == live
    table = kv.get_block_table("c")
    assert table[1][:2] == [0, 0] and all(b != 0 for b in table[0])
    kv.check_integrity()


def test_scheduler_serves_long_prompts_in_a_cache_smaller_than_one_full_table():
    """Two 60-token prompts (+4 tokens) need 16 blocks each in a full table; the window group
    holds at most 4 (keys of a chunk of 8 and the 5 before it), so both run at once in a
    44-block cache (a single-table cache of both layers would need 2 x 16 blocks of 2 layers,
    64 blocks of this size)."""
    groups = group_layers([SW6, FULL])
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=128),
        CacheConfig(block_size=BS, enable_prefix_caching=False),
        44,
        kv_groups=groups,
    )
    for i in range(2):
        r = req(f"r{i}", 60, start=1000 * (i + 1))
        r.max_tokens = 4
        s.add_request(r)
    most_used = most_running = 0
    for _ in range(40):
        so = s.schedule()
        s.update_from_output(so, fake_run(so, s))
        s.kv_cache_manager.check_integrity()
        most_used = max(most_used, 43 - s.kv_cache_manager.num_free_blocks())
        most_running = max(most_running, len(s.running))
        if not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests() and s.num_preemptions == 0
    assert most_running == 2 and most_used <= 2 * (16 + 4)
    assert s.kv_cache_manager.is_idle_clean()


def test_bad_group_block_size():
    with pytest.raises(ValueError, match="block_size"):
        make_kv_cache_manager(group_layers([SW6, FULL]), 10, 8, False)
