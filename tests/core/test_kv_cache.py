"""KV cache manager and block pool with no model: block ids, ref counts, integrity."""

from __future__ import annotations

import pytest

from pagedllm.core.kv_cache.block import FreeBlockQueue, KVCacheBlock
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams


def make_req(rid: str, n: int, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=100))


def test_free_block_queue_o1_ops():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    q.appendleft(blocks[2])
    assert [b.block_id for b in q] == [2, 1, 3, 4, 0]
    assert len(q) == 5
    with pytest.raises(ValueError):
        q.append(blocks[1])  # already queued
    for _ in range(5):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


def test_allocate_append_free_exact_ids():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", 6)
    blocks = kv.allocate_slots(a, 6)
    assert [b.block_id for b in blocks] == [0, 1]
    a.num_computed_tokens = 6
    kv.check_integrity()
    # 2 more tokens fit in block 1 (6 + 2 = 8 = 2 blocks): nothing new
    assert kv.allocate_slots(a, 2) == []
    a.num_computed_tokens = 8
    # the 9th token needs a third block
    assert [b.block_id for b in kv.allocate_slots(a, 1)] == [2]
    b = make_req("b", 3)
    assert [x.block_id for x in kv.allocate_slots(b, 3)] == [3]
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert all(blk.ref_cnt == 1 for blk in kv.req_to_blocks["a"])
    kv.check_integrity()
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    kv.check_integrity()
    assert kv.num_free_blocks() == 7
    # never-cached blocks return to the FRONT, tail first: next allocation reuses 0, 1, 2
    c = make_req("c", 12)
    assert [x.block_id for x in kv.allocate_slots(c, 12)] == [0, 1, 2]
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_req("a", 12)
    assert kv.allocate_slots(a, 12) is not None  # 3 blocks
    b = make_req("b", 8)
    assert kv.allocate_slots(b, 8) is None  # needs 2, 1 free
    assert "b" not in kv.req_to_blocks
    assert kv.num_free_blocks() == 1
    kv.check_integrity()


def test_lookahead_slots():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", 4)
    # 4 tokens + 3 lookahead (speculative) slots -> 2 blocks
    assert len(kv.allocate_slots(a, 4, num_lookahead_tokens=3)) == 2


def test_double_free_detected():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_req("a", 4)
    blocks = kv.allocate_slots(a, 4)
    kv.block_pool.free_blocks(blocks)
    with pytest.raises(ValueError):
        kv.block_pool.free_blocks(blocks)


def test_integrity_catches_leak():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_req("a", 4)
    kv.allocate_slots(a, 4)
    kv.req_to_blocks.pop("a")  # a table forgets its block: the block leaks
    with pytest.raises(AssertionError):
        kv.check_integrity()
