"""Copy-on-write forks with no model: ref counts and block ids through fork, write, free."""

from __future__ import annotations

from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.output import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams
from tests.core.test_scheduler import make_scheduler


def req(rid: str, n: int) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=8))


def test_fork_shares_then_copies_on_write():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    parent = req("p", 6)
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    assert kv.get_block_ids("p") == [0, 1]
    child = req("c", 6)
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert kv.get_block_ids("c") == [0, 1]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    kv.check_integrity()
    # the child writes position 6, inside shared block 1: it gets a private copy
    assert kv.allocate_slots(child, 1) == []
    assert kv.get_block_ids("c") == [0, 2]
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.take_replaced("c") == [(0, 1, 2)]  # (group, table index, new block)
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]
    # the parent now owns block 1 alone: no copy when it writes
    assert kv.allocate_slots(parent, 1) == []
    assert kv.take_pending_copies() == [] and kv.get_block_ids("p") == [0, 1]
    kv.check_integrity()
    # full shared block 0 is never written: no copy for it, ever
    child.num_computed_tokens = 7
    assert [b.block_id for b in kv.allocate_slots(child, 2)] == [3]  # positions 7, 8
    assert kv.take_pending_copies() == []
    for r in (parent, child):
        r.status = RequestStatus.FINISHED_STOPPED
        kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks() == 10


def test_fork_on_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    parent = req("p", 8)
    kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    child = req("c", 8)
    child.num_computed_tokens = 8
    kv.fork(parent, child)
    assert [b.block_id for b in kv.allocate_slots(child, 1)] == [2]
    assert kv.take_pending_copies() == []


def test_cow_counts_against_free_blocks():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    parent = req("p", 6)
    kv.allocate_slots(parent, 6)  # both blocks
    parent.num_computed_tokens = 6
    child = req("c", 6)
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert kv.allocate_slots(child, 1) is None  # the copy needs a free block: none
    assert kv.take_pending_copies() == [] and kv.get_block_ids("c") == [0, 1]
    kv.check_integrity()


def test_scheduler_forks_n_sequences_and_frees_all():
    s = make_scheduler(num_blocks=20, block_size=4)
    r = Request(
        "r",
        list(range(100, 106)),
        SamplingParams(n=3, temperature=1.0, max_tokens=3, ignore_eos=True),
    )
    s.add_request(r)
    so = s.schedule()
    out = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[7]], forked_token_ids={"r": [8, 9]})
    outs = s.update_from_output(so, out)
    assert {(o.request_id, tuple(o.new_token_ids)) for o in outs} == {
        ("r", (7,)),
        ("r#1", (8,)),
        ("r#2", (9,)),
    }
    assert all(o.parent_id == "r" for o in outs)
    kv = s.kv_cache_manager
    assert kv.get_block_ids("r#1") == kv.get_block_ids("r") == [0, 1]
    assert kv.block_pool.blocks[1].ref_cnt == 3
    so = s.schedule()
    # every sequence writes position 6 in shared block 1: two copies, the last writer keeps it
    assert so.num_scheduled_tokens == {"r": 1, "r#1": 1, "r#2": 1}
    assert len(so.blocks_to_copy) == 2 and all(src == 1 for src, _ in so.blocks_to_copy)
    assert {n.req_id for n in so.scheduled_new_reqs} == {"r#1", "r#2"}
    kv.check_integrity()
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)  # abort takes the whole group
    assert not s.has_unfinished_requests() and kv.num_free_blocks() == 20
    kv.check_integrity()


def test_group_preempted_all_or_nothing():
    s = make_scheduler(num_blocks=5, block_size=4, max_len=64)
    s.add_request(
        Request("a", list(range(100, 104)), SamplingParams(max_tokens=20, ignore_eos=True))
    )
    g = Request(
        "g",
        list(range(200, 206)),
        SamplingParams(n=2, temperature=1.0, max_tokens=20, ignore_eos=True),
    )
    g.arrival_time = s.requests["a"].arrival_time + 1
    s.add_request(g)
    so = s.schedule()
    s.update_from_output(
        so,
        ModelRunnerOutput(
            req_ids=["a", "g"], sampled_token_ids=[[5], [6]], forked_token_ids={"g": [7]}
        ),
    )
    preempted = set()
    for _ in range(20):
        so = s.schedule()
        preempted |= so.preempted_req_ids
        if so.preempted_req_ids:
            assert so.preempted_req_ids == {"g", "g#1"}  # the whole group at once
            break
        ids = list(so.num_scheduled_tokens)
        s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[5]] * len(ids)))
        s.kv_cache_manager.check_integrity()
    assert preempted == {"g", "g#1"}
    s.kv_cache_manager.check_integrity()


def test_group_reserves_its_slots_and_too_wide_is_rejected():
    import pytest

    s = make_scheduler(num_blocks=50, block_size=4, max_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        s.add_request(Request("wide", [1, 2, 3], SamplingParams(n=5, temperature=1.0)))
    for i in range(3):
        s.add_request(Request(f"r{i}", [10 + i, 2, 3], SamplingParams(max_tokens=5)))
    s.add_request(Request("g", [9, 9, 9], SamplingParams(n=2, temperature=1.0, max_tokens=5)))
    so = s.schedule()
    assert "g" not in so.num_scheduled_tokens  # 3 running + 2 sequences > 4
    ids = list(so.num_scheduled_tokens)
    s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[5]] * len(ids)))
    assert len(s.running) <= 4
