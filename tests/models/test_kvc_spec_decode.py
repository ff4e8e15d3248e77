"""KV-Compress with speculative decoding (ngram and suffix drafts) on tiny random models (fp32,
the CPU here). The rules (``pagedllm/core/sched/kvc.py``): rejected drafts' KVs leave every
head; a verify row's queries of real tokens (its last known token's and its accepted drafts')
score the keys as decode steps would; an eviction due after a verify step runs after its
update, from the true lengths. So:

- nothing evicted: the tokens are KV-Compress alone's and the plain engine's (speculation is
  lossless on the per-head cache), through chunked prefill, preemption and async steps;
- compress_once (one eviction, after the prompt): KV-Compress alone's tokens and evictions;
- continual compression evicts after each verify step, not after each token, so the tokens
  are not KV-Compress alone's evicting every step. They are exactly those of KV-Compress alone
  evicting at the lengths where the speculating engine evicted (a planner replaying them):
  same cache, same scores at every eviction - the strongest equality that holds;
- every step: the manager's per-head lengths are the device's (less the rejected drafts it
  drops before the next step), the protected window is whole in every head, no block leaks.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchParams
from pagedllm.core.sched.connector import scheduler_role_swapped
from pagedllm.core.sched.kvc import KVCompressPlanner
from tests.models.test_spec_decode import NGRAM, NGRAM_GPU, SUFFIX, _prompts

MAX_TOKENS = 40


def _engine(path: str, **kw: Any) -> LLM:
    return LLM(path, dtype="float32", max_model_len=256, **kw)


def _tokens(
    llm: LLM, prompts: list, lengths: list[int] | None = None, **params: Any
) -> list[list[int]]:
    """Greedy tokens (``lengths``: each request's max_tokens, MAX_TOKENS without them)."""
    sp = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **params)
        for n in lengths or [MAX_TOKENS] * len(prompts)
    ]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    core = llm.llm_engine.engine_core
    core.check_integrity()
    assert core.scheduler.kv_cache_manager.is_idle_clean()
    return [list(o.outputs[0].token_ids) for o in outs]


def _drafts(llm: LLM) -> tuple[float, float]:
    """(draft tokens verified, accepted)."""
    m = {x.name: x for x in llm.get_metrics()}
    return (
        m["vllm:spec_decode_num_draft_tokens"].value,
        m["vllm:spec_decode_num_accepted_tokens"].value,
    )


def _kv(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager


def _accepted_and_rejected(llm: LLM) -> None:
    drafted, accepted = _drafts(llm)
    assert 0 < accepted < drafted  # drafts were kept and drafts were dropped


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_no_eviction_equals_kvc_alone_and_plain(tiny_models, arch: str) -> None:
    """A budget above every request's length (its keys scored: the verify rows' queries kept
    and scored, the dropped drafts' KVs too), and no budget at all (nothing scored): the
    plain engine's greedy tokens. Gemma 3: window layers that keep their KVs beside one that
    is scored."""
    path = tiny_models(arch)
    prompts = _prompts()
    want = _tokens(_engine(path), prompts)
    assert _tokens(_engine(path, enable_kvc=True), prompts, max_cache_tokens=250) == want
    for spec, budget in ((NGRAM, 250), (SUFFIX, 250), (NGRAM, None)):
        llm = _engine(path, enable_kvc=True, speculative_config=spec)
        assert _tokens(llm, prompts, max_cache_tokens=budget) == want, (spec, budget)
        _accepted_and_rejected(llm)
        assert _kv(llm).num_evicted_kvs == 0


@pytest.mark.parametrize(
    "engine_kw",
    [
        {"max_num_batched_tokens": 16},  # chunked prefill, drafts cut by the budget
        {"num_gpu_blocks_override": 60, "block_size": 8},  # preemption by recompute
        {"async_scheduling": True},  # asked for: speculating steps are synchronous
    ],
    ids=["chunked", "preempt", "async"],
)
def test_no_eviction_equals_plain_with_engine_features(tiny_models, engine_kw: dict) -> None:
    path = tiny_models("llama")
    prompts = _prompts()
    want = _tokens(_engine(path), prompts)
    llm = _engine(path, enable_kvc=True, speculative_config=NGRAM, **engine_kw)
    assert _tokens(llm, prompts, max_cache_tokens=250) == want
    _accepted_and_rejected(llm)
    if "num_gpu_blocks_override" in engine_kw:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    "budget",
    [
        {"max_cache_tokens": 16, "protected_window_size": 4},
        {"compression_rate": 2.0, "protected_window_size": 3},
    ],
    ids=["max_cache_tokens", "compression_rate"],
)
def test_compress_once_equals_kvc_alone(tiny_models, budget: dict) -> None:
    """One eviction per request, after its prompt (a step that verifies no drafts): then
    speculation verifies drafts over the evicted cache, and the tokens and evictions are
    KV-Compress alone's. Some prompts share a prefix (cached, protected from eviction); async
    scheduling asked for; speculation paused while 3 or more requests run (those steps
    asynchronous, the prompts' evictions in flight), then speculating synchronously."""
    path = tiny_models("llama")
    prompts = _prompts()
    shared = prompts[5]["prompt_token_ids"]
    prompts += [{"prompt_token_ids": shared[:32] + p["prompt_token_ids"][:9]} for p in prompts[:3]]
    params = {**budget, "compress_once": True}
    lengths = [MAX_TOKENS] * 2 + [12] * (len(prompts) - 2)  # then two requests alone
    alone = _engine(path, enable_kvc=True)
    want = _tokens(alone, prompts, lengths, **params)
    assert _kv(alone).num_evicted_kvs > 0
    paused = {**NGRAM, "disable_by_batch_size": 3}
    for spec, kw in ((NGRAM, {}), (SUFFIX, {"async_scheduling": True}),
                     (paused, {"async_scheduling": True})):  # fmt: skip
        llm = _engine(path, enable_kvc=True, speculative_config=spec, **kw)
        assert _tokens(llm, prompts, lengths, **params) == want, spec
        _accepted_and_rejected(llm)
        kv = _kv(llm)
        assert kv.num_compressions == _kv(alone).num_compressions <= len(prompts)
        assert kv.num_evicted_kvs == _kv(alone).num_evicted_kvs
        if spec is paused:
            core = llm.llm_engine.engine_core
            assert 0 < core.num_async_steps < core.num_steps


# the evictions the speculating engine applied: request -> the computed tokens of each
_APPLIED: dict[str, set[int]] = {}


class RecordingPlanner(KVCompressPlanner):
    """KV-Compress's planner, recording where each eviction it applies was (its request's
    computed tokens)."""

    def update(self, metadata: Any, output: Any) -> None:
        if metadata is not None:
            for e in metadata.pre_evictions + metadata.evictions:
                if e.req_id in self.inflight:  # (not forgotten: applied now)
                    _APPLIED.setdefault(e.req_id, set()).add(e.computed)
        super().update(metadata, output)


class ReplayPlanner(KVCompressPlanner):
    """KV-Compress's planner, evicting a request exactly where ``_APPLIED`` says (after the
    step whose tokens reach those lengths), and nowhere else."""

    def eviction_due(self, request: Any, after: int) -> bool:
        if after != request.num_tokens + request.num_output_placeholders:
            return False
        return after in _APPLIED.get(request.request_id, ())


def _planner(name: str) -> AbstractContextManager[None]:
    return scheduler_role_swapped("kvcompress", f"{__name__}:{name}")


@pytest.mark.parametrize(
    "arch,spec,budget",
    [
        ("llama", NGRAM, {"max_cache_tokens": 16, "protected_window_size": 4}),
        ("llama", SUFFIX, {"compression_rate": 2.0, "protected_window_size": 3}),
        # every layer windowed and compacted: the verify queries' window found by position
        ("mistral", NGRAM, {"compression_rate": 2.0, "protected_window_size": 3}),
        ("gemma3", SUFFIX, {"max_cache_tokens": 12, "protected_window_size": 4}),
    ],
    ids=["llama-ngram-tokens", "llama-suffix-rate", "mistral-ngram-rate", "gemma3-suffix"],
)
def test_continual_equals_kvc_alone_evicting_at_the_same_lengths(
    tiny_models, arch: str, spec: dict, budget: dict
) -> None:
    """Continual compression (every step; a verify step counts as one): the speculating
    engine evicts after each verify step, KV-Compress alone after each token, so their tokens
    differ once an eviction falls inside a stretch of accepted drafts. KV-Compress alone
    evicting at the speculating engine's lengths instead gives its very tokens and evicts as
    many KVs: the accepted drafts' queries scored as its decode queries, the rejected ones'
    not at all, and each eviction saw the same cache and scores."""
    path = tiny_models(arch)
    prompts = _prompts()
    _APPLIED.clear()
    with _planner("RecordingPlanner"):
        llm = _engine(path, enable_kvc=True, speculative_config=spec)
    got = _tokens(llm, prompts, **budget)
    _accepted_and_rejected(llm)
    drafted, accepted = _drafts(llm)
    points = sum(len(v) for v in _APPLIED.values())
    # after each prompt, then after each later step (fewer steps than tokens: drafts accepted)
    assert len(prompts) < points < len(prompts) * MAX_TOKENS
    with _planner("ReplayPlanner"):
        replay = _engine(path, enable_kvc=True)
    assert _tokens(replay, prompts, **budget) == got
    assert _kv(replay).num_evicted_kvs == _kv(llm).num_evicted_kvs > 0


def _check_step(core: Any, protect: int) -> None:
    """The manager's per-head lengths are the device's, less the rejected drafts' KVs the
    device drops before the next step; in every head of every running request the last
    ``protect`` positions are all there."""
    sched, runner = core.scheduler, core.model_runner
    kv, planner, cache = sched.kv_cache_manager, sched.connectors[0], runner.kv_layout
    for rid, state in kv.states.items():
        row = runner.input_batch.req_id_to_row.get(rid)
        r = sched.requests.get(rid)
        if row is None or r is None or r.swapped:
            continue
        lens = state.lens - (state.num_tokens - r.num_computed_tokens)  # computed KVs
        device = cache.lens[row].numpy() - planner._trims.get(rid, 0)
        assert np.array_equal(device, lens), rid
        want = set(range(max(r.num_computed_tokens - protect, 0), r.num_computed_tokens))
        for lh in np.flatnonzero(kv.compressible):
            n = int(lens[lh])
            idx = np.arange(n)
            slots = cache.tables[row, lh, idx // kv.block_size].numpy() * kv.block_size
            held = set(cache.positions[slots + idx % kv.block_size].tolist())
            assert want <= held, (rid, lh, sorted(want - held))


@pytest.mark.parametrize(
    "budget",
    [
        {"max_cache_tokens": 8, "protected_window_size": 6},
        {"compression_rate": 3.0, "protected_window_size": 5},
    ],
    ids=["max_cache_tokens", "compression_rate"],
)
def test_every_step_lengths_agree_window_kept_nothing_leaks(tiny_models, budget: dict) -> None:
    """Continual compression, one step at a time, in a small cache (with compression_rate 3
    too small for every request: evictions make room and some requests are preempted): the
    checks of ``_check_step`` after every step, every request completes, every block comes
    back."""
    # the cache is sized so that these prompts' evictions with the paper's max-pool (7) leave
    # some requests to preempt (which KVs go, and so how heads' blocks free, follows the pool)
    llm = _engine(
        tiny_models("llama"), enable_kvc=True, speculative_config=NGRAM, block_size=4,
        num_gpu_blocks_override=150, maxpool_kernel=7,
    )  # fmt: skip
    core = llm.llm_engine.engine_core
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **budget)
    prompts = _prompts(8)
    for i, p in enumerate(prompts):
        llm.llm_engine.add_request(str(i), p, sp)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
        core.check_integrity()
        _check_step(core, budget["protected_window_size"])
    assert all(len(t) == MAX_TOKENS for t in tokens.values())
    _accepted_and_rejected(llm)
    kv = _kv(llm)
    assert kv.num_evicted_kvs > 0 and kv.is_idle_clean()
    if "compression_rate" in budget:
        assert core.scheduler.num_preemptions > 0


def test_unsupported_combinations_name_the_field(tiny_models) -> None:
    path = tiny_models("llama")
    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    for spec in (NGRAM_GPU, draft):
        with pytest.raises(ValueError, match="speculative_config.method.*enable_kvc"):
            _engine(path, enable_kvc=True, speculative_config=spec)
    llm = _engine(path, enable_kvc=True, speculative_config=NGRAM)
    with pytest.raises(ValueError, match="beam search"):
        llm.beam_search(
            [{"prompt_token_ids": [5, 6]}], BeamSearchParams(beam_width=2, max_tokens=4)
        )


@pytest.mark.parametrize("arch,spec", [("gemma3", SUFFIX)])
def test_spec_decode_with_kvc_over_two_ranks_equals_one(tiny_models, arch: str, spec: dict):
    """Speculative decoding with KV-Compress under tensor parallelism (two gloo ranks, a KV
    head each; async steps asked for): each rank drops its heads' rejected drafts' KVs and
    scores its heads' keys with the verify rows' queries it kept, and the evictions choose
    across both ranks' heads as one rank would. Without eviction, with one after the prompt
    and with continual compression: one rank's tokens and evicted KVs, drafts kept and
    dropped. (Gemma 3, suffix drafts: window layers that keep their KVs beside compressed
    ones; llama with ngram drafts passes too, left out for the suite's time.)"""
    path = tiny_models(arch)
    prompts = _prompts()
    kw = {"enable_kvc": True, "speculative_config": spec, "async_scheduling": True,
          "device": "cpu", "kv_cache_memory_bytes": 32 << 20}  # fmt: skip
    one, two = _engine(path, **kw), _engine(path, tensor_parallel_size=2, **kw)
    try:
        for params in ({"max_cache_tokens": 200},
                       {"max_cache_tokens": 16, "protected_window_size": 4, "compress_once": True},
                       {"compression_rate": 2.0, "protected_window_size": 3}):  # fmt: skip
            evicted = _kv(one).num_evicted_kvs, _kv(two).num_evicted_kvs
            assert _tokens(two, prompts, **params) == _tokens(one, prompts, **params), params
            now = _kv(one).num_evicted_kvs - evicted[0]
            assert _kv(two).num_evicted_kvs - evicted[1] == now
            assert (now > 0) == ("max_cache_tokens" not in params or "compress_once" in params)
        _accepted_and_rejected(two)
    finally:
        two.llm_engine.engine_core.shutdown()
