"""KV-Compress with speculative decoding, without a model: rejected drafts' KVs leave every
head (and their blocks the pool), an eviction due after a verify step waits for its update and
is planned from the true lengths, ``make_room`` never picks a request verifying drafts, and
the engine runs synchronous steps while a step with host drafts is in flight."""

from __future__ import annotations

import numpy as np

from pagedllm.core.kv_cache.head_paged import HeadPagedKVCacheManager
from pagedllm.core.kv_cache.spec import HeadPagedSpec
from pagedllm.core.request import Request
from pagedllm.core.sched.kvc import KVCReport
from pagedllm.core.sched.output import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams

BS = 4
LH = 6  # 3 layers x 2 KV heads


def _spec() -> HeadPagedSpec:
    return HeadPagedSpec(BS, 2, 8, 4, num_layers=3, compressible=(True,) * 3)


def test_drop_last_frees_the_blocks_past_the_new_lengths():
    kv = HeadPagedKVCacheManager(_spec(), num_blocks=100)
    r = Request("a", list(range(3, 13)), SamplingParams(max_tokens=8))
    kv.allocate_slots(r, 10)  # 10 KVs a head: 3 blocks each, 18 in all
    r.num_computed_tokens = 10
    kv.apply_compaction(r, np.array([10, 7, 4, 3, 9, 1]))  # heads of different lengths
    free = kv.num_free_blocks()
    r.append_output_token_ids(20)
    kv.allocate_slots(r, 1 + 4)  # the last known token and 4 drafts: [15, 12, 9, 8, 14, 6]
    r.num_computed_tokens += 5
    assert kv.num_free_blocks() == free - 7  # a block a head, head 2 two
    kv.check_integrity()
    r.num_computed_tokens -= 3  # 1 draft accepted: 3 rejected
    assert kv.drop_last(r, 3) == 4  # a block of heads 0, 2, 4 and 5 goes back
    state = kv.states["a"]
    assert state.lens.tolist() == [12, 9, 6, 5, 11, 3]
    assert state.num_tokens == r.num_computed_tokens == 12
    assert kv.num_free_blocks() == free - 3
    kv.check_integrity()
    assert kv.drop_last(r, 0) == 0
    # a request never evicted from keeps every head alike (its fast path's rule)
    u = Request("u", list(range(3, 9)), SamplingParams(max_tokens=8))
    kv.allocate_slots(u, 6 + 4)
    u.num_computed_tokens = 7
    assert kv.drop_last(u, 3) == LH  # 10 -> 7 KVs: 3 blocks -> 2 in every head
    assert kv.states["u"].uniform and kv.states["u"].lens.tolist() == [7] * LH
    kv.check_integrity()
    kv.free(r)
    kv.free(u)
    assert kv.is_idle_clean()


def _scheduler(num_blocks: int = 200, **kvc: object):
    from pagedllm.config import CacheConfig, KVCompressConfig, SchedulerConfig
    from pagedllm.core.kv_cache.spec import KVCacheGroup, KVCacheGroups
    from pagedllm.core.sched.scheduler import Scheduler
    from pagedllm.spec_decode import SpeculativeConfig

    spec = _spec()
    groups = KVCacheGroups((KVCacheGroup(spec, (0, 1, 2)),), 1, (spec,))
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256),
        CacheConfig(block_size=BS),
        num_blocks,
        kv_groups=groups,
        kvc_config=KVCompressConfig(enabled=True, **kvc),
        spec_config=SpeculativeConfig.from_dict(ngram),
    )


def _update(sched, so, samples: dict[str, list[int]], lens=None):
    ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(
        ids, [samples.get(r, []) for r in ids], kv_connector_output={"kvcompress": lens}
    )
    return sched.update_from_output(so, out)


def test_eviction_due_after_a_verify_step_runs_after_its_update():
    """Continual compression: the prompt is evicted after its step; the next step verifies
    4 drafts and plans no eviction (one is due); its update drops the 2 rejected drafts' KVs
    and plans the eviction from the true lengths (computed tokens, protected window); the step
    after carries the drop, the scoring queries and that eviction, to run before its forward
    pass. Meanwhile the engine may not plan a step ahead."""
    sched = _scheduler(max_cache_tokens=8, protected_window_size=4)
    kvm, planner = sched.kv_cache_manager, sched.connectors[0]
    phrase = [10, 11, 12, 13, 14]
    r = Request("r", phrase * 3, SamplingParams(max_tokens=30, ignore_eos=True), eos_token_id=2)
    sched.add_request(r)
    so = sched.schedule()  # the prompt (15 tokens), evicted after it
    meta = so.kv_connector_metadata["kvcompress"]
    assert [e.computed for e in meta.evictions] == [15] and not meta.pre_evictions
    _update(sched, so, {"r": [10]}, KVCReport({"r": np.full(LH, 8)}))
    assert kvm.states["r"].lens.tolist() == [8] * LH
    so = sched.schedule()  # ... 13, 14, 10 -> drafts 11, 12, 13, 14
    assert so.scheduled_spec_tokens == {"r": [11, 12, 13, 14]}
    assert so.num_scheduled_tokens == {"r": 5}
    meta = so.kv_connector_metadata["kvcompress"]
    assert not meta.evictions and not meta.pre_evictions  # due, but not before the update
    assert kvm.states["r"].lens.tolist() == [13] * LH
    sched.spec.paused = lambda *args: True  # (speculation paused from now on)
    assert sched.needs_sync  # its drafts come back before the next step is planned
    _update(sched, so, {"r": [11, 12, 99, 5, 6]})  # 2 accepted: 11, 12, then 99
    assert not sched.needs_sync
    assert r.num_computed_tokens == 18 and r.output_token_ids[-3:] == [11, 12, 99]
    assert kvm.states["r"].lens.tolist() == [11] * LH  # 8 + the token and 2 drafts
    kvm.check_integrity()
    so = sched.schedule()  # a plain decode step: its eviction is due after it too
    assert so.num_scheduled_tokens == {"r": 1}
    meta = so.kv_connector_metadata["kvcompress"]
    assert meta.trims == {"r": 2} and meta.verified == {"r": 3}
    (pre,) = meta.pre_evictions
    assert (pre.computed, pre.protect_from, pre.budget, pre.held) == (18, 14, 8 * LH, 11 * LH)
    (post,) = meta.evictions
    assert (post.computed, post.protect_from) == (19, 15)
    calls = []
    apply = kvm.apply_compaction

    def recording(request, lens, computed=None):
        calls.append((lens.tolist(), computed))
        return apply(request, lens, computed)

    kvm.apply_compaction = recording
    keep, keep2 = np.array([8, 7, 9, 8, 6, 10]), np.full(LH, 7)
    _update(sched, so, {"r": [7]}, KVCReport({"r": keep2}, pre={"r": keep}))
    assert calls == [(keep.tolist(), 18), (keep2.tolist(), 19)]  # the one before first
    assert kvm.states["r"].lens.tolist() == [7] * LH
    kvm.check_integrity()
    assert not planner.inflight


def test_make_room_skips_requests_verifying_drafts():
    """A request whose step verifies drafts is never evicted for room after that step (its
    rejected drafts' KVs are dropped at the update first); the others are."""
    sched = _scheduler(max_cache_tokens=4, compress_once=True)
    planner = sched.connectors[0]
    phrase = [10, 11, 12, 13, 14]
    for rid in "ab":
        sp = SamplingParams(max_tokens=30, ignore_eos=True)
        sched.add_request(Request(rid, phrase * 3, sp, eos_token_id=2))
    so = sched.schedule()
    lens = KVCReport({e.req_id: np.full(LH, 12) for e in so.kv_connector_metadata["kvcompress"]
                      .evictions})  # fmt: skip
    _update(sched, so, {"a": [10], "b": [10]}, lens)
    so = sched.schedule()  # both verify 4 drafts
    assert so.num_scheduled_tokens == {"a": 5, "b": 5}
    ra, rb = sched.requests["a"], sched.requests["b"]
    # b as if it were scheduled without drafts: its computed tokens are its known ones
    rb.num_computed_tokens = rb.num_tokens + rb.num_output_placeholders
    planner._room = {}
    assert planner._mark_for_room({}, 1)
    assert set(planner._room) == {"b"}
    assert ra.num_computed_tokens > ra.num_tokens + ra.num_output_placeholders


def test_rejected_drafts_leave_a_request_without_a_budget():
    """A request that is never evicted (no budget) still drops its rejected drafts' KVs: the
    next step's plan carries the drop (and no scoring: its keys are not scored)."""
    sched = _scheduler()
    kvm = sched.kv_cache_manager
    phrase = [10, 11, 12, 13, 14]
    r = Request("r", phrase * 3, SamplingParams(max_tokens=30, ignore_eos=True), eos_token_id=2)
    sched.add_request(r)
    so = sched.schedule()
    assert so.kv_connector_metadata["kvcompress"].scored == frozenset()
    _update(sched, so, {"r": [10]})
    so = sched.schedule()
    assert so.scheduled_spec_tokens == {"r": [11, 12, 13, 14]}
    _update(sched, so, {"r": [5, 6, 7, 8, 9]})  # none accepted
    assert kvm.states["r"].lens.tolist() == [16] * LH and r.num_computed_tokens == 16
    meta = sched.schedule().kv_connector_metadata["kvcompress"]
    assert meta.trims == {"r": 4} and not meta.verified and not meta.pre_evictions
    kvm.check_integrity()
