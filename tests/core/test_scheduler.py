"""Scheduler with no model: exact tokens per step, chunking, preemption, abort, integrity."""

from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams


def make_scheduler(
    budget=1024,
    max_seqs=16,
    num_blocks=1000,
    block_size=16,
    max_len=4096,
    chunked=True,
    caching=False,
    policy="fcfs",
    clock=None,
    **cache_kw,
) -> Scheduler:
    extra = {"clock": clock} if clock is not None else {}
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            max_model_len=max_len,
            enable_chunked_prefill=chunked,
            policy=policy,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching, **cache_kw),
        num_blocks,
        _host_blocks(cache_kw),
        **extra,
    )


def _host_blocks(cache_kw: dict) -> int:
    """In these tests swap_space_bytes counts host blocks directly."""
    return cache_kw.get("swap_space_bytes", 0)


_clock = [0.0]


def make_req(rid: str, n: int, max_tokens: int = 100, **kw) -> Request:
    """Distinct prompts (no prefix shared by accident) arriving one second apart."""
    _clock[0] += 1.0
    start = 1 + int(_clock[0]) * 10_000
    return Request(
        rid,
        list(range(start, start + n)),
        SamplingParams(max_tokens=max_tokens, **kw),
        eos_token_id=0,
        arrival_time=_clock[0],
    )


def fake_run(so: SchedulerOutput, sched: Scheduler, token: int = 7) -> ModelRunnerOutput:
    """What a model runner would return: one token for every request that reached its end."""
    ids, toks = [], []
    for rid in so.num_scheduled_tokens:
        req = sched.requests[rid]
        ids.append(rid)
        toks.append([token] if req.num_computed_tokens == req.num_tokens else [])
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks)


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    so = sched.schedule()
    sched.update_from_output(so, fake_run(so, sched, token))
    sched.kv_cache_manager.check_integrity()
    return so


def test_budget_split_400_400_224_then_catch_up():
    s = make_scheduler(budget=1024)
    for rid, n in (("a", 400), ("b", 400), ("c", 600)):
        s.add_request(make_req(rid, n))
    so = step(s)
    assert so.num_scheduled_tokens == {"a": 400, "b": 400, "c": 224}
    assert [r.req_id for r in so.scheduled_new_reqs] == ["a", "b", "c"]
    so = step(s)
    # running first, in arrival order: a and b decode, c gets the rest of its prompt
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 376}
    assert [r.req_id for r in so.scheduled_cached_reqs] == ["a", "b", "c"]
    assert so.scheduled_new_reqs == []
    so = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    assert s.requests["a"].output_token_ids == [7, 7, 7]
    assert s.requests["c"].output_token_ids == [7, 7]


def test_tiny_budget_chunks_prompt():
    s = make_scheduler(budget=16)
    s.add_request(make_req("a", 40))
    assert [step(s).num_scheduled_tokens["a"] for _ in range(3)] == [16, 16, 8]
    assert s.requests["a"].num_output_tokens == 1  # sampled only when the prompt completed
    assert step(s).num_scheduled_tokens == {"a": 1}


def test_no_chunking_waits_for_budget():
    s = make_scheduler(budget=64, max_len=64, chunked=False)
    s.add_request(make_req("a", 50))
    s.add_request(make_req("b", 30))
    so = step(s)
    assert so.num_scheduled_tokens == {"a": 50}  # b (30) does not fit in the 14 left
    so = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 30}


def test_max_num_seqs_caps_running():
    s = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add_request(make_req(f"r{i}", 4))
    assert list(step(s).num_scheduled_tokens) == ["r0", "r1"]
    assert len(s.waiting) == 1


def test_preempts_latest_arrival_and_resumes_identically():
    # 6 blocks of 4 tokens = 24 slots. Two requests of 8 tokens each take 2 blocks; decoding
    # grows them until the pool runs dry and the later arrival is preempted by recompute.
    s = make_scheduler(num_blocks=6, block_size=4, max_len=64)
    s.add_request(make_req("a", 8, max_tokens=12))
    s.add_request(make_req("b", 8, max_tokens=12))
    preempted_at = None
    for i in range(40):
        so = step(s)
        if so.preempted_req_ids:
            assert so.preempted_req_ids == {"b"}  # the most recently arrived
            assert s.requests["b"].status == RequestStatus.PREEMPTED
            assert s.requests["b"].num_computed_tokens == 0
            assert "b" in so.finished_req_ids or "b" in s.finished_req_ids
            preempted_at = i
            break
    assert preempted_at is not None
    # b waits at the front and no one is admitted in the preempting step
    assert s.waiting.peek().request_id == "b"
    # b comes back as a NEW request carrying its outputs so far, recomputed from scratch
    b_outputs = list(s.requests["b"].output_token_ids)
    resumed = None
    for _ in range(60):
        so = step(s)
        for new in so.scheduled_new_reqs:
            if new.req_id == "b":
                resumed = new
        if not s.has_unfinished_requests():
            break
    assert resumed is not None
    assert resumed.output_token_ids == b_outputs and resumed.num_computed_tokens == 0
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks() == 6


def test_abort_frees_everything_and_informs_runner():
    s = make_scheduler(num_blocks=20, block_size=4)
    s.add_request(make_req("a", 10))
    s.add_request(make_req("b", 10))
    step(s)
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks() == 20
    so = s.schedule()
    assert so.finished_req_ids == {"a", "b"} and so.total_num_scheduled_tokens == 0
    assert not s.has_unfinished_requests()
    s.kv_cache_manager.check_integrity()


def test_abort_while_waiting():
    s = make_scheduler(max_seqs=1)
    s.add_request(make_req("a", 4))
    s.add_request(make_req("b", 4))
    step(s)
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert len(s.waiting) == 0
    assert "b" not in s.schedule().finished_req_ids  # the runner never saw b


def test_stop_conditions():
    s = make_scheduler()
    s.add_request(make_req("eos", 4, max_tokens=10))
    s.add_request(make_req("len", 4, max_tokens=2, ignore_eos=True))
    s.add_request(make_req("stop_id", 4, max_tokens=10, stop_token_ids=[5]))
    s.add_request(make_req("min", 4, max_tokens=10, min_tokens=3))
    step(s, token=0)  # eos for everyone
    assert "eos" not in s.requests  # finished on EOS
    assert s.requests["len"].num_output_tokens == 1
    assert s.requests["min"].num_output_tokens == 1  # EOS ignored below min_tokens
    step(s, token=5)
    assert "len" not in s.requests and "stop_id" not in s.requests
    step(s, token=0)
    assert "min" not in s.requests
    assert not s.has_unfinished_requests()


def test_rejects_what_can_never_run():
    s = make_scheduler(num_blocks=4, block_size=4, max_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_req("long", 65))
    with pytest.raises(ValueError, match="KV cache"):
        s.add_request(make_req("huge", 20))  # 16 slots in all
    s.add_request(make_req("ok", 10, max_tokens=100))
    assert s.requests["ok"].max_tokens == 6  # capped so it always fits alone
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_req("ok", 3))


def test_many_requests_integrity_every_step():
    s = make_scheduler(budget=64, max_seqs=8, num_blocks=24, block_size=4, max_len=64)
    for i in range(20):
        s.add_request(make_req(f"r{i}", 3 + (i * 7) % 20, max_tokens=1 + i % 9))
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        so = step(s)
        assert so.total_num_scheduled_tokens <= 64
        assert len(s.running) <= 8
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks() == 24


def test_paced_speculation_pauses_for_a_burst_not_for_a_queue_behind_full_seats() -> None:
    """``disable_when_slower``: requests that free seats could take now pause speculation
    while there are more than max(2, running / 16) of them (a batch being admitted); a queue
    behind max_num_seqs does not (speculating frees the seats sooner)."""
    from pagedllm.spec_decode import SpeculativeConfig

    spec = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "disable_when_slower": True}
    )

    def sched(max_seqs: int) -> Scheduler:
        s = Scheduler(
            SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=max_seqs,
                            max_model_len=4096),
            CacheConfig(block_size=16), 1000, 0, spec_config=spec,
        )  # fmt: skip
        for i in range(4):
            s.add_request(make_req(f"r{i}", 8))
        return s

    free = sched(max_seqs=8)  # 8 seats: the 4 are a burst to admit
    assert free._admittable() == 4 and free.schedule().spec_paused
    full = sched(max_seqs=1)  # 1 seat: the first request takes it, 3 queue behind it
    assert not full.schedule().spec_paused  # 1 to admit: no burst
    assert full._admittable() == 0 and len(full.waiting) == 3
    assert not full.schedule().spec_paused
