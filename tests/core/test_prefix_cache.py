"""Automatic prefix caching with no model: hits, ref counts, LRU eviction, collisions, salt."""

from __future__ import annotations

from pagedllm.core.kv_cache import hashing
from pagedllm.core.kv_cache.block import BlockHash
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import make_scheduler, step


def req(rid: str, tokens: list[int], salt: str | None = None, **kw) -> Request:
    r = Request(rid, tokens, SamplingParams(max_tokens=8, **kw), eos_token_id=0)
    r.cache_salt = salt
    return r


def run_prefill(kv: KVCacheManager, r: Request) -> list[int]:
    """Admit r as the scheduler would: prefix hit, then allocate the rest."""
    hit_blocks, hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - hit, hit_blocks) is not None
    r.num_computed_tokens = r.num_tokens
    return kv.get_block_ids(r.request_id)


def finish(kv: KVCacheManager, r: Request) -> None:
    r.status = RequestStatus.FINISHED_STOPPED
    kv.free(r)


def test_hit_shares_blocks_with_ref_counts():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = req("a", list(range(10)))  # blocks: [0-3], [4-7], partial [8-9]
    assert run_prefill(kv, a) == [0, 1, 2]
    b = req("b", list(range(8)) + [99, 98, 97])
    blocks, hit = kv.get_computed_blocks(b)
    assert [x.block_id for x in blocks] == [0, 1] and hit == 8
    assert run_prefill(kv, b) == [0, 1, 3]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.check_integrity()
    finish(kv, a)
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [1, 1, 0]
    finish(kv, b)
    kv.check_integrity()
    assert kv.num_free_blocks() == 10


def test_hit_capped_below_num_tokens():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = req("a", list(range(8)))
    run_prefill(kv, a)
    finish(kv, a)
    # the same 8 tokens again: at most 7 may be reused -> only block 0 (4 tokens)
    b = req("b", list(range(8)))
    blocks, hit = kv.get_computed_blocks(b)
    assert [x.block_id for x in blocks] == [0] and hit == 4


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=True)
    a = req("a", list(range(12)))  # 3 full blocks 0, 1, 2
    run_prefill(kv, a)
    finish(kv, a)
    # free queue: never-cached 3, 4, 5 first, then a's blocks tail first: 2, 1, 0
    assert [b.block_id for b in kv.block_pool.free_block_queue] == [3, 4, 5, 2, 1, 0]
    c = req("c", list(range(100, 116)))  # 4 blocks: takes 3, 4, 5 then evicts 2 (a's tail)
    assert run_prefill(kv, c) == [3, 4, 5, 2]
    assert kv.block_pool.num_evictions == 1
    a2 = req("a2", list(range(12)) + [7])
    blocks, hit = kv.get_computed_blocks(a2)
    assert [x.block_id for x in blocks] == [0, 1] and hit == 8  # the parents survived
    kv.check_integrity()


def test_hash_collision_guarded_by_token_ids(monkeypatch):
    import hashlib

    class Constant:
        def __init__(self, *a):
            pass

        def update(self, *a):
            pass

        def digest(self):
            return b"same"

    monkeypatch.setattr(hashing, "hashlib", type("H", (), {"sha256": Constant}))
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = req("a", [1, 2, 3, 4, 5])
    run_prefill(kv, a)
    b = req("b", [9, 9, 9, 9, 5])  # same digest, other tokens: must not hit
    assert kv.get_computed_blocks(b) == ([], 0)
    assert isinstance(hashing.hash_block(None, [1]), BlockHash)
    assert hashlib.sha256  # the real module is untouched elsewhere


def test_cache_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    run_prefill(kv, req("a", list(range(9)), salt="tenant-1"))
    assert kv.get_computed_blocks(req("b", list(range(9)), salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(req("c", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(req("d", list(range(9)), salt="tenant-1"))[1] == 8


def test_prompt_logprobs_requests_skip_the_cache():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    run_prefill(kv, req("a", list(range(9))))
    assert kv.get_computed_blocks(req("b", list(range(9)), prompt_logprobs=1))[1] == 0


def test_scheduler_reports_cached_tokens_and_resumes_from_cache():
    s = make_scheduler(budget=256, num_blocks=64, block_size=4, caching=True)
    shared = list(range(1000, 1032))  # 8 full blocks
    s.add_request(Request("a", shared + [1], SamplingParams(max_tokens=4), eos_token_id=0))
    step(s)
    s.add_request(Request("b", shared + [2, 3], SamplingParams(max_tokens=4), eos_token_id=0))
    so = step(s)
    assert so.num_scheduled_tokens["b"] == 2  # only the suffix is computed
    assert s.requests["b"].num_cached_tokens == 32
    while s.has_unfinished_requests():
        step(s)
    kv = s.kv_cache_manager
    assert kv.prefix_cache_hits == 32 and kv.prefix_cache_queries == 33 + 34


def test_preempted_request_resumes_mostly_from_cache():
    s = make_scheduler(num_blocks=6, block_size=4, max_len=64, caching=True)
    s.add_request(
        Request("a", list(range(100, 108)), SamplingParams(max_tokens=12, ignore_eos=True))
    )
    s.add_request(
        Request("b", list(range(200, 208)), SamplingParams(max_tokens=12, ignore_eos=True))
    )
    resumed_hits = []
    for _ in range(80):
        so = step(s)
        resumed_hits += [
            n.num_computed_tokens
            for n in so.scheduled_new_reqs
            if s.requests.get(n.req_id) and s.requests[n.req_id].num_preemptions
        ]
        if not s.has_unfinished_requests():
            break
    assert s.num_preemptions > 0 and resumed_hits and max(resumed_hits) > 0
