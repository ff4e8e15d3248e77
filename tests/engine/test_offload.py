"""The host KV tier (``kv_offloading_size``, issue 54): prefix blocks the device pool gave up
come back from host memory with the same greedy tokens (and logprobs) as a cold run and as
recomputation; the tier stays within its size under churn; bad settings are refused with the
field named."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.sched.offload import OffloadScheduler

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
BLOCK = 16


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=n).tolist()


def _llm(tiny_models: Callable[[str], str], arch: str = "llama", **kw: Any) -> LLM:
    # 24 device blocks of 16 tokens: two 150-token prompts (10 blocks each) fill it
    kw = {"max_model_len": 256, "num_gpu_blocks_override": 24, "max_num_seqs": 2, **kw}
    kw.setdefault("device", "cpu")
    return LLM(tiny_models(arch), dtype="float32", seed=0, **kw)


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
        )
        for o in outs
    ]


def _tier(llm: LLM) -> OffloadScheduler:
    core = llm.llm_engine.engine_core
    return next(c for c in core.scheduler.connectors if isinstance(c, OffloadScheduler))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_evicted_prefix_comes_back_from_the_host_tier(tiny_models, async_scheduling):
    """A 150-token prompt, then four others that push its blocks out of the 24-block device
    pool, then the first again: its 9 full blocks (the last token is always computed) come
    from the host tier, and its tokens and logprobs equal the cold run's and those of an engine
    without the tier (which recomputes them)."""
    a = _prompt(1, 150)
    others = [_prompt(s, 150) for s in range(2, 6)]
    kw = {"async_scheduling": async_scheduling}
    llm = _llm(tiny_models, kv_offloading_size=0.01, **kw)
    cold = _run(llm, [a])
    tier = _tier(llm)
    assert tier.hit_tokens == 0 and tier.saved_blocks >= 9
    _run(llm, others)
    again = _run(llm, [a])
    assert tier.hit_tokens == 9 * BLOCK and tier.loaded_blocks == 9
    assert tier.queried_tokens == 6 * 9 * BLOCK  # each admission looked 9 blocks up once
    plain = _run(_llm(tiny_models, **kw), [a] + others + [a])
    for (toks, lps), (ref_toks, ref_lps) in ((again[0], cold[0]), (again[0], plain[-1])):
        assert toks == ref_toks
        np.testing.assert_allclose(lps, ref_lps, rtol=1e-5, atol=1e-5)
    stats = llm.llm_engine.engine_core.stats()
    assert stats["offload_hit_tokens"] == 9 * BLOCK
    assert stats["offload_bytes_moved"] > 0


def test_a_small_tier_evicts_least_recently_used_and_stays_exact(tiny_models):
    """A tier of 12 blocks under 8 requests of 11 full blocks each (170 prompt tokens, 8
    out), one at a time, a device pool that holds one: the tier never holds more than 12
    blocks, and least recently used go first, a request's tail before its head: once the 8th
    request's 11 blocks are in, the 7th keeps its head block, which its rerun loads. Every
    request's tokens equal those of the engine without the tier."""
    prompts = [_prompt(s, 170) for s in range(10, 18)]
    kw = {"num_gpu_blocks_override": 12, "max_num_seqs": 1}
    block_bytes = _tier(_llm(tiny_models, kv_offloading_size=0.01)).block_bytes
    llm = _llm(tiny_models, kv_offloading_size=12 * block_bytes / 2**30, **kw)
    tier = _tier(llm)
    assert tier.num_host_blocks == 12
    order = prompts + [prompts[-2]]
    got = _run(llm, order)
    assert len(tier.entries) == 12 and tier.skipped_saves == 0
    assert tier.hit_tokens == BLOCK and tier.saved_blocks == 8 * 11 + 10  # (rerun: 1 held)
    assert not tier.busy and not tier.landing
    ref = _run(_llm(tiny_models, **kw), order)
    assert [t for t, _ in got] == [t for t, _ in ref]


def test_prefix_shared_inside_the_tier_and_the_device(tiny_models):
    """A prompt that shares 4 blocks with one the device still holds and more with one only
    the tier holds gets the device's first, then the tier's rest."""
    base = _prompt(30, 200)
    llm = _llm(tiny_models, kv_offloading_size=0.01)
    _run(llm, [base])
    _run(llm, [_prompt(s, 150) for s in range(31, 34)])  # base leaves the device
    tier = _tier(llm)
    got = _run(llm, [base[:180] + _prompt(40, 20)])
    assert tier.hit_tokens == 180 // BLOCK * BLOCK
    ref = _run(_llm(tiny_models), [base[:180] + _prompt(40, 20)])
    assert got[0][0] == ref[0][0]


def test_bad_settings_are_refused_with_the_field_named(tiny_models):
    with pytest.raises(ValueError, match="kv_offloading_size"):
        _llm(tiny_models, kv_offloading_size=-1)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        _llm(tiny_models, kv_offloading_size=0.01, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="smaller than one KV block"):
        _llm(tiny_models, kv_offloading_size=1e-9)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kv_compress_blocks_come_back_from_the_host_tier(tiny_models, arch):
    """KV-Compress (one-head blocks): a prompt's cached entries - a block of every (layer, KV
    head) - are saved as rows while it runs, from the device cache's entries (which keep the
    prompt's KVs whole while its request is evicted from), the device gives them up under four
    more prompts, and a rerun loads them, computing the last 32 tokens itself (the queries
    that score what it keeps). Its tokens and logprobs equal the cold run's and an engine's
    without the tier, with a budget that evicts nothing and with one that evicts."""
    a = _prompt(1, 150)
    others = [_prompt(s, 150) for s in range(2, 6)]
    lh = {"llama": 4, "gemma3": 8}[arch]  # (layers x KV heads: one-head blocks per token block)
    kw = {"enable_kvc": True, "num_gpu_blocks_override": 16 * lh, "max_num_seqs": 1}
    for budget in (200, 24):
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0,
                            max_cache_tokens=budget, protected_window_size=8)  # fmt: skip

        def run(llm: LLM, prompts: list[list[int]], sp: SamplingParams = sp) -> list:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            llm.llm_engine.engine_core.check_integrity()
            return [(list(o.outputs[0].token_ids),
                     [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                    for o in outs]  # fmt: skip

        llm = _llm(tiny_models, arch, kv_offloading_size=0.01, **kw)
        assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.num_heads == lh
        cold = run(llm, [a])
        tier = _tier(llm)
        assert tier.saved_blocks >= 9 and tier.hit_tokens == 0
        run(llm, others)
        (again,) = run(llm, [a])
        assert tier.hit_tokens == (150 - 32) // BLOCK * BLOCK  # 7 blocks
        plain = run(_llm(tiny_models, arch, **kw), [a] + others + [a])
        for toks, lps in (cold[0], plain[-1]):
            assert again[0] == toks
            np.testing.assert_allclose(again[1], lps, rtol=1e-5, atol=1e-5)
        evicted = llm.llm_engine.engine_core.scheduler.kv_cache_manager.num_evicted_kvs
        assert (evicted > 0) == (budget < 150)


@pytest.mark.parametrize("one_table", [False, True])
def test_sliding_window_layers_use_the_tier(tiny_models, one_table):
    """Gemma 3 (window layers): with the hybrid manager each group's blocks are saved under
    its own key and a hit loads every group's (a window group's whole, its next step drops
    what left the window); with one table (disable_hybrid_kv_cache_manager) as any model.
    Tokens and logprobs equal the engine without the tier, the rerun's its cold run's."""
    a = _prompt(50, 150)
    order = [a] + [_prompt(s, 150) for s in range(51, 57)] + [a]
    kw = {
        "disable_hybrid_kv_cache_manager": one_table,
        "max_num_seqs": 1,
        # one table: a request holds 11 blocks; hybrid: 10 + chunks of 32 in the window
        # groups, and the tier's loads take every group's blocks at once (see external_hit)
        "num_gpu_blocks_override": 30 if one_table else 80,
        "max_num_batched_tokens": 32,
    }
    llm = _llm(tiny_models, "gemma3", kv_offloading_size=0.01, **kw)
    hybrid = type(llm.llm_engine.engine_core.scheduler.kv_cache_manager).__name__
    assert (hybrid == "HybridKVCacheManager") is not one_table
    got = _run(llm, order)
    tier = _tier(llm)
    assert tier.hit_tokens > 0
    assert tier.loaded_blocks == tier.hit_tokens // BLOCK * len(tier.tables)
    ref = _run(_llm(tiny_models, "gemma3", **kw), order)
    for (toks, lps), (ref_toks, ref_lps) in zip(got, ref):
        assert toks == ref_toks
        np.testing.assert_allclose(lps, ref_lps, rtol=1e-5, atol=1e-5)
    assert got[-1][0] == got[0][0]


def test_the_server_exports_the_tiers_counters(tiny_models):
    """/metrics: no offload series without the tier; with it, its hits and bytes as the
    engine's stats count them."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from pagedllm.metrics import ServerMetrics

    m = ServerMetrics("tiny")
    m.record({"num_running_reqs": 0}, [])
    assert "kv_offload" not in generate_latest(m.registry).decode()
    a = _prompt(60, 150)
    llm = _llm(tiny_models, kv_offloading_size=0.01)
    _run(llm, [a] + [_prompt(s, 150) for s in range(61, 65)] + [a])
    stats = llm.llm_engine.engine_core.stats()
    m.record(stats, [])
    text = generate_latest(m.registry).decode()
    label = '{model_name="tiny"}'
    assert f"pagedllm:kv_offload_hits_total{label} {float(stats['offload_hit_tokens'])}" in text
    assert stats["offload_hit_tokens"] == 9 * BLOCK
    moved = (stats["offload_loaded_blocks"] + stats["offload_saved_blocks"]) * _tier(
        llm
    ).block_bytes
    assert stats["offload_bytes_moved"] == moved > 0


def test_tensor_parallel_ranks_each_keep_their_shard(tiny_models):
    """TP = 2 (gloo, worker processes): each rank's worker role keeps its KV heads' host
    copies; the evicted prefix comes back with the tokens of one engine without the tier."""
    a = _prompt(70, 150)
    order = [a] + [_prompt(s, 150) for s in range(71, 75)] + [a]
    llm = _llm(tiny_models, kv_offloading_size=0.01, tensor_parallel_size=2)
    try:
        got = _run(llm, order)
        assert _tier(llm).hit_tokens == 9 * BLOCK
    finally:
        llm.llm_engine.engine_core.shutdown()
    ref = _run(_llm(tiny_models), order)
    assert [t for t, _ in got] == [t for t, _ in ref]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kvc", [False, True], ids=["plain", "kv_compress"])
def test_on_a_gpu_the_copies_are_asynchronous_and_exact(tiny_models, kvc):
    """CUDA, async scheduling, CUDA graphs: loads staged through pinned memory, saves on a
    side stream; the tokens equal the engine without the tier's, and the prompt whose prefix
    came back from the host equals its cold run (KV-Compress: one-head blocks as rows, no
    eviction, the last 32 tokens computed)."""
    a = _prompt(80, 150)
    order = [a] + [_prompt(s, 150) for s in range(81, 85)] + [a]
    kw: dict[str, Any] = {"device": "cuda"}
    if kvc:  # (llama: 4 one-head blocks per token block)
        kw |= {"enable_kvc": True, "num_gpu_blocks_override": 64, "max_num_seqs": 1}
    llm = _llm(tiny_models, kv_offloading_size=0.01, **kw)
    got = _run(llm, order)
    assert _tier(llm).hit_tokens == (7 if kvc else 9) * BLOCK
    ref = _run(_llm(tiny_models, **kw), order)
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert got[-1][0] == got[0][0]


def test_a_preempted_request_resumes_from_the_tier(tiny_models):
    """Preemption by recompute with the tier on: the victim's full blocks were written through,
    so it resumes loading them instead of recomputing its context, with the tokens of the
    engine without the tier."""
    prompts = [_prompt(s, 60) for s in (90, 91)]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    kw = {"num_gpu_blocks_override": 12}

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    llm = _llm(tiny_models, kv_offloading_size=0.01, **kw)
    got = run(llm)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert _tier(llm).hit_tokens > 0
    assert got == run(_llm(tiny_models, **kw))


def test_preemption_by_swap_goes_through_the_tier(tiny_models):
    """preemption_mode 'swap' with the tier on: the tier is the swap space (no swap_space
    needed); a victim whose full blocks it holds is preempted without a second copy and
    resumes loading them, with the tokens of the engine that swaps to a host pool of its own.
    A tier that lacks a victim's blocks (too small to hold them) leaves it to swap."""
    prompts = [_prompt(s, 60) for s in (92, 93)]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    kw = {"num_gpu_blocks_override": 12, "preemption_mode": "swap"}

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    llm = _llm(tiny_models, kv_offloading_size=0.01, **kw)
    got = run(llm)
    sched = llm.llm_engine.engine_core.scheduler
    assert sched.num_preemptions > 0 and sched.num_swaps == 0
    assert _tier(llm).hit_tokens > 0
    ref = _llm(tiny_models, swap_space=0.01, **kw)
    assert run(ref) == got
    assert ref.llm_engine.engine_core.scheduler.num_swaps > 0
    # a tier of 2 blocks holds no victim's chain: swapping, as without it
    block_gib = _tier(llm).block_bytes / 2**30
    small = _llm(tiny_models, kv_offloading_size=2 * block_gib, swap_space=0.01, **kw)
    assert run(small) == got
    assert small.llm_engine.engine_core.scheduler.num_swaps > 0


def test_the_chat_replay_benchmark_runs_every_turn(tiny_models):
    """benchmarks/kv_offload.py at a tiny scale, the tier on: every conversation runs every
    turn (closed loops), later turns load their history from the tier, TTFTs are measured."""
    import argparse

    from benchmarks.kv_offload import replay, working_set_tokens

    a = argparse.Namespace(
        model=tiny_models("llama"), load_format="auto", dtype="float32", device="cpu",
        conversations=6, concurrency=2, turns=3, system_len=64, turn_len=16, output_len=4,
        pool_fraction=0.5,
        max_model_len=256, seed=0,
    )  # fmt: skip
    assert working_set_tokens(a) == 64 + 6 * 3 * 20
    r = replay(a, "on")
    assert r["requests"] == 6 * 3 and r["offload_hit_tokens"] > 0
    assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
    assert r["last_prompt_tokens_mean"] == 64 + 3 * 16 + 2 * 4


def test_naming_the_connector_too_makes_one_tier(tiny_models):
    """kv_connectors='offload' beside kv_offloading_size: one tier; named without a size:
    refused with the field named."""
    llm = _llm(tiny_models, kv_offloading_size=0.01, kv_connectors="offload")
    roles = llm.llm_engine.engine_core.scheduler.connectors
    assert [type(c).__name__ for c in roles] == ["OffloadScheduler"]
    with pytest.raises(ValueError, match="kv_offloading_size"):
        _llm(tiny_models, kv_connectors="offload")
