"""KV-Compress through the engine on tiny random models: exact when nothing is evicted (against
HF and against the engine without it, with chunked prefill, preemption, swap and async steps),
budgets kept, memory given back, forks, aborts, and the errors a user gets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchParams

# the prompts (several longer than the tiny Mistral's and Gemma 3's windows) and the HF
# reference of the equality tests
from tests.models.test_hf_equality import (  # noqa: E402
    ARCHS,
    MAX_NEW,
    PROMPT_LENS,
    _prompts,
)


def _run(path: str, params: dict | None = None, prompts=None, **engine_kw):
    llm = LLM(path, dtype="float32", max_model_len=256, enable_kvc=True, **engine_kw)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **(params or {}))
    prompts = prompts or _prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    core = llm.llm_engine.engine_core
    core.check_integrity()
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_budget_above_length_equals_hf(arch, tiny_models, reference):
    """A budget of at least prompt + output evicts nothing: HF's greedy tokens exactly."""
    llm, tokens = _run(tiny_models(arch), {"max_cache_tokens": 200})
    assert tokens == reference(arch)[0]
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.num_evicted_kvs == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize(
    "engine_kw",
    [
        dict(max_num_batched_tokens=16),  # chunked prefill
        dict(block_size=8, num_gpu_blocks_override=60),  # recompute preemption
        dict(block_size=8, num_gpu_blocks_override=60, preemption_mode="swap", swap_space=0.01),
        dict(async_scheduling=True, max_num_batched_tokens=32),
    ],
    ids=["chunked", "recompute", "swap", "async"],
)
def test_no_eviction_equals_hf_under_chunks_preemption_async(
    arch, engine_kw, tiny_models, reference
):
    if arch == "gemma3" and "num_gpu_blocks_override" in engine_kw:
        engine_kw = {**engine_kw, "num_gpu_blocks_override": 120}  # 4 layers: 2x the heads
    llm, tokens = _run(tiny_models(arch), {"max_cache_tokens": 200}, **engine_kw)
    assert tokens == reference(arch)[0]
    if "num_gpu_blocks_override" in engine_kw:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("method", ["kvcompress", "uniform", "random"])
def test_compression_keeps_the_budget(method, tiny_models):
    """After each eviction a request holds at most its budget (its protected window aside);
    every prompt longer than the budget is compressed; the integrity checks pass each time."""
    llm, tokens = _run(
        tiny_models("llama"),
        {"max_cache_tokens": 16, "protected_window_size": 4},
        kvc_method=method,
    )
    core = llm.llm_engine.engine_core
    kv = core.scheduler.kv_cache_manager
    assert all(len(t) == MAX_NEW for t in tokens)
    assert kv.num_compressions >= sum(n > 16 for n in PROMPT_LENS)
    assert kv.num_evicted_kvs > 0
    assert kv.is_idle_clean()


def test_budget_respected_after_every_eviction(tiny_models):
    llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True)
    core = llm.llm_engine.engine_core
    kv = core.scheduler.kv_cache_manager
    heads = int(kv.compressible.sum())
    sp = SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, max_cache_tokens=16,
        protected_window_size=4,
    )  # fmt: skip
    llm.llm_engine.add_request("a", {"prompt_token_ids": _prompts()[5]}, sp)
    seen = 0
    while core.has_unfinished_requests():
        core.step()
        core.check_integrity()
        if kv.num_compressions > seen:
            seen = kv.num_compressions
            assert kv.kept_kvs.get("a", 0) <= 16 * heads
    assert seen >= 2  # after the prompt, then continually while decoding


def test_compression_rate_budget(tiny_models):
    llm, _ = _run(
        tiny_models("llama"), {"compression_rate": 4.0, "protected_window_size": 2,
                               "compress_once": True}, prompts=[_prompts()[5]],
    )  # fmt: skip
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.num_compressions == 1  # once, after the prompt
    heads = int(kv.compressible.sum())
    # 64 prompt tokens (+ the first sampled one computed later) / 4 -> at most 16 per head
    assert kv.num_evicted_kvs >= 64 * heads - 16 * heads


def test_compression_instead_of_preemption(tiny_models):
    """A cache too small for every request uncompressed: with a budget, evictions make room
    and fewer requests are preempted than without one."""
    kw = dict(block_size=8, num_gpu_blocks_override=120)
    llm_full, _ = _run(tiny_models("llama"), {"max_cache_tokens": 200}, **kw)
    llm_kvc, tokens = _run(
        tiny_models("llama"), {"max_cache_tokens": 16, "protected_window_size": 4}, **kw
    )
    full = llm_full.llm_engine.engine_core.scheduler.num_preemptions
    kvc = llm_kvc.llm_engine.engine_core.scheduler.num_preemptions
    assert full > 0 and kvc < full
    assert all(len(t) == MAX_NEW for t in tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cuda_graphs_equal_eager_with_evictions(arch, tiny_models):
    """Decode steps replayed from CUDA graphs (persistent per-head tables read through row
    ids, padding rows on the empty row) give the eager engine's tokens while evicting every
    step, and the graphs were used."""
    params = {"max_cache_tokens": 24, "protected_window_size": 4}
    results = []
    for eager in (True, False):
        llm, tokens = _run(tiny_models(arch), params, enforce_eager=eager)
        runner = llm.llm_engine.engine_core.model_runner
        assert (runner.graph_runner is None) == eager
        assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.num_compressions > 0
        results.append(tokens)
    assert results[0] == results[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_equal_eager_splitting_long_heads(tiny_models, monkeypatch):
    """Scored heads longer than ``SKEW_SPLITS``'s T tiles take the long-head split (T lowered
    to 2 tiles, splits of 2 tiles or more, and the SM count to 1, so that a tiny model's
    batch takes it): in CUDA graphs and eagerly, the same tokens."""
    import pagedllm.ops.kvc_attention.decode as kvc_ops

    monkeypatch.setattr(kvc_ops, "SKEW_SPLITS", (4, 2, 2))
    monkeypatch.setattr(kvc_ops, "_num_sms", lambda device: 1)
    launches = []
    real = kvc_ops._long_split_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(grid)
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(kvc_ops, "_long_split_kernel", Spy())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 250, size=n).tolist() for n in (150, 200, 40, 180, 230, 90)]
    params = {"max_cache_tokens": 250, "protected_window_size": 4}  # scored, nothing evicted
    results = []
    for eager in (True, False):
        before = len(launches)
        results.append(_run(tiny_models("llama"), params, prompts, enforce_eager=eager)[1])
        assert len(launches) > before
    assert results[0] == results[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_without_the_score_pass_when_no_row_is_scored(tiny_models):
    """Requests with a budget and requests without, in one batch, then alone: the decode steps
    with no scored row replay the graphs built without the score pass, the others the scored
    ones, and every request's tokens equal the eager engine's."""
    prompts = _prompts()
    budgeted = {"max_cache_tokens": 24, "protected_window_size": 4}
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW + 8 * (i % 2), ignore_eos=True,
                       **(budgeted if i % 2 else {}))
        for i in range(len(prompts))
    ]  # fmt: skip
    results, replays = [], None
    for eager in (True, False):
        llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True,
                  enforce_eager=eager)  # fmt: skip
        # a mixed batch (the budgeted requests run longer: their last steps are all scored),
        # then the unbudgeted requests alone (no row scored in any step)
        mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        alone = llm.generate(
            [{"prompt_token_ids": p} for p in prompts[::2]], params[::2], use_tqdm=False
        )
        llm.llm_engine.engine_core.check_integrity()
        results.append([o.outputs[0].token_ids for o in mixed + alone])
        if not eager:
            replays = llm.llm_engine.engine_core.model_runner.graph_runner.replays
    assert results[0] == results[1]
    assert replays[True] > 0 and replays[False] > 0


def _step_all(llm, params, prompts, on_step=None):
    """Every prompt through ``core.step()`` one step at a time, the integrity checks after
    each; returns each request's tokens."""
    core = llm.llm_engine.engine_core
    for i, p in enumerate(prompts):
        llm.llm_engine.add_request(str(i), {"prompt_token_ids": p}, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
        core.check_integrity()
        if on_step is not None:
            on_step(core)
    return [tokens[str(i)] for i in range(len(prompts))]


def test_async_evictions_equal_sync(tiny_models):
    """Evictions do not force synchronous steps: under async scheduling the step after an
    eviction is planned before its new lengths come back (on the old ones), and the tokens
    equal the synchronous engine's, which applies each eviction first - continual compression
    of every request every step, so that each step's plan meets the last one's evictions."""
    sp = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, max_cache_tokens=16,
        protected_window_size=4,
    )  # fmt: skip
    results, cores = [], []
    for async_scheduling in (False, True):
        llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True,
                  async_scheduling=async_scheduling)  # fmt: skip
        results.append(_step_all(llm, sp, _prompts()))
        cores.append(llm.llm_engine.engine_core)
    assert results[0] == results[1]
    sync, asyn = cores
    kv_sync, kv_async = (c.scheduler.kv_cache_manager for c in cores)
    assert kv_sync.num_compressions == kv_async.num_compressions > len(_prompts())
    assert kv_sync.num_evicted_kvs == kv_async.num_evicted_kvs
    assert sync.num_async_steps == 0
    assert asyn.num_async_steps == asyn.num_steps > 0


def test_async_evictions_under_memory_pressure(tiny_models):
    """A cache too small for every request: evictions make room while steps stay
    asynchronous. Each eviction's lengths come back after the next step was planned (its
    tokens are added to them), the integrity checks pass after every step, every request
    completes, and fewer are preempted than without budgets."""
    prompts = _prompts() + [[t + 1 for t in p] for p in _prompts()]  # (no prefix shared)
    kw = dict(block_size=8, num_gpu_blocks_override=120, async_scheduling=True)
    late = []  # tokens allocated after an eviction's step when its lengths came back

    def run(budget):
        llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True,
                  **kw)  # fmt: skip
        kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
        apply = kv.apply_compaction

        def recording(request, lens, computed=None):
            late.append(kv.states[request.request_id].num_tokens - computed)
            return apply(request, lens, computed)

        kv.apply_compaction = recording
        sp = SamplingParams(
            temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, max_cache_tokens=budget,
            protected_window_size=4, compress_once=True,
        )  # fmt: skip
        return llm.llm_engine.engine_core, _step_all(llm, sp, prompts)

    full, _ = run(256)
    core, tokens = run(16)
    assert all(len(t) == MAX_NEW for t in tokens)
    assert core.num_async_steps == core.num_steps
    assert core.scheduler.kv_cache_manager.num_compressions > sum(len(p) > 16 for p in prompts)
    assert max(late) >= 1  # the next step's token was allocated before the lengths came back
    assert 0 < full.scheduler.num_preemptions
    assert core.scheduler.num_preemptions < full.scheduler.num_preemptions
    assert core.scheduler.kv_cache_manager.is_idle_clean()


@pytest.mark.parametrize("num_blocks", [100, 160])
def test_evictions_in_flight_make_room_without_preemption(num_blocks, tiny_models):
    """Under async scheduling a step is planned before the last step's evictions come back:
    a request short of blocks waits for what they free rather than preempting another (which
    would recompute its prompt). Caches where the synchronous engine preempts nobody."""
    prompts = _prompts() + [[t + 1 for t in p] for p in _prompts()]
    sp = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, max_cache_tokens=16,
        protected_window_size=4, compress_once=True,
    )  # fmt: skip
    preemptions = []
    for async_scheduling in (False, True):
        llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True,
                  block_size=8, num_gpu_blocks_override=num_blocks,
                  async_scheduling=async_scheduling)  # fmt: skip
        tokens = _step_all(llm, sp, prompts)
        assert all(len(t) == MAX_NEW for t in tokens)
        preemptions.append(llm.llm_engine.engine_core.scheduler.num_preemptions)
    assert preemptions == [0, 0]


def test_async_admissions_wait_for_the_evictions_that_free_their_blocks(tiny_models):
    """Long prompts in a cache that holds one uncompressed prompt beside the compressed
    ones: each admission needs the blocks the eviction of the prompt before it frees. Under
    async scheduling that eviction is still in flight when the next step is planned; the
    engine takes its lengths first (``Scheduler.wants_results_first``), so the prompts are
    admitted a step apart as in the synchronous engine (not two: 35 steps against its 28
    without the wait) and the tokens equal its."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, size=120).tolist() for _ in range(8)]
    sp = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, max_cache_tokens=16,
        protected_window_size=4, compress_once=True,
    )  # fmt: skip
    results, cores = [], []
    for async_scheduling in (False, True):
        # 2 layers x 2 KV heads, bs 8: a prompt takes 60 of the 100 blocks, 8 once evicted
        llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True,
                  block_size=8, num_gpu_blocks_override=100, max_num_batched_tokens=128,
                  async_scheduling=async_scheduling)  # fmt: skip
        results.append(_step_all(llm, sp, prompts))
        cores.append(llm.llm_engine.engine_core)
    sync, asyn = cores
    assert results[0] == results[1]
    assert asyn.num_results_first > 0 and asyn.num_async_steps == asyn.num_steps
    # async: the last step of each of the two waves of requests runs again (its token
    # dropped), and a last call only collects the results
    assert asyn.num_steps <= sync.num_steps + 3
    assert sync.num_results_first == 0 and sync.scheduler.num_preemptions == 0


def test_evictions_of_different_widths_in_one_step_equal_one_call(tiny_models, monkeypatch):
    """A request evicted continually (a few KVs a head) and a long prompt evicted after its
    prefill in the same steps: the runner evicts them in separate calls of their own widths
    (``width_groups``), and the tokens equal those of one call over both."""
    import pagedllm.kvcompress.runner as model_runner

    groups = model_runner.width_groups
    sizes: list[int] = []

    def recording(widths, ratio=4):
        out = groups(widths, ratio)
        sizes.append(len(out))
        return out

    sp = {
        name: SamplingParams(
            temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, max_cache_tokens=budget,
            protected_window_size=2,
        )
        for name, budget in (("short", 4), ("long", 12))
    }  # fmt: skip

    def lens_agree(core):  # the manager's per-head lengths are the device's
        runner = core.model_runner
        for rid, state in core.scheduler.kv_cache_manager.states.items():
            row = runner.input_batch.req_id_to_row[rid]
            assert np.array_equal(runner.kv_layout.lens[row].numpy(), state.lens), rid

    results = []
    for split in (recording, lambda widths, ratio=4: [list(range(len(widths)))]):
        monkeypatch.setattr(model_runner, "width_groups", split)
        llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True,
                  block_size=4)  # fmt: skip
        core = llm.llm_engine.engine_core
        prompts = _prompts()
        llm.llm_engine.add_request("short", {"prompt_token_ids": prompts[1]}, sp["short"])
        tokens: dict[str, list[int]] = {"short": [], "long": []}
        for step in range(MAX_NEW + 4):
            if step == 3:  # its prefill ends while the short one is evicted every step
                long = prompts[5] + prompts[2]  # 104 tokens: 4x the short one's longest head
                llm.llm_engine.add_request("long", {"prompt_token_ids": long}, sp["long"])
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
            core.check_integrity()
            lens_agree(core)
        while core.has_unfinished_requests():
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
        results.append(tokens)
    assert max(sizes) == 2  # a step evicted in two calls
    assert results[0] == results[1]
    assert all(len(t) == MAX_NEW for t in results[0].values())


def test_no_eviction_for_room_that_cannot_make_it(tiny_models):
    """Memory short, budgets just below the prompts: evicting a few KVs each step would not
    give a stalled request its blocks, so the scheduler preempts instead of evicting again and
    again (a request is compressed about once, after its prompt, not every step)."""
    prompts = [p for p in _prompts() if len(p) >= 40] * 3  # 6 requests of 40 and 64 tokens
    llm = LLM(
        tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True,
        block_size=8, num_gpu_blocks_override=60,
    )  # fmt: skip
    sp = SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, max_cache_tokens=60,
        protected_window_size=4, compress_once=True,
    )  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    core = llm.llm_engine.engine_core
    core.check_integrity()
    kv = core.scheduler.kv_cache_manager
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert kv.num_compressions <= 2 * len(prompts)  # 61 before the rule, 9 with it
    assert kv.is_idle_clean()


def test_window_layers_keep_their_kvs(tiny_models):
    """Gemma 3's sliding-window layers are not compressed: their heads keep every KV."""
    llm = LLM(tiny_models("gemma3"), dtype="float32", max_model_len=256, enable_kvc=True)
    core = llm.llm_engine.engine_core
    kv = core.scheduler.kv_cache_manager
    sp = SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, max_cache_tokens=8,
        protected_window_size=2,
    )  # fmt: skip
    llm.llm_engine.add_request("g", {"prompt_token_ids": _prompts()[5]}, sp)
    while kv.num_compressions == 0:  # the prompt, then its eviction (a step later if async)
        core.step()
    state = kv.states["g"]
    comp = kv.compressible
    assert not comp.all() and comp.any()
    # every token allocated so far (64, or 65 when async scheduling already placed the next)
    assert state.num_tokens >= 64
    assert (state.lens[~comp] == state.num_tokens).all()
    assert (state.lens[comp] < 64).all()


def test_parallel_sampling_each_sequence_compresses_its_own(tiny_models):
    llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True)
    sp = SamplingParams(
        n=3, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True, max_cache_tokens=16,
        protected_window_size=4,
    )  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": _prompts()[2]}], sp, use_tqdm=False)
    core = llm.llm_engine.engine_core
    core.check_integrity()
    kv = core.scheduler.kv_cache_manager
    assert len(outs[0].outputs) == 3 and all(len(c.token_ids) == 12 for c in outs[0].outputs)
    assert kv.num_cow_copies > 0  # the forks copied the shared blocks before writing
    assert kv.is_idle_clean()


def test_abort_mid_way_leaks_nothing(tiny_models):
    llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True)
    core = llm.llm_engine.engine_core
    sp = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, max_cache_tokens=16,
        protected_window_size=4,
    )  # fmt: skip
    for i, p in enumerate(_prompts()):
        llm.llm_engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    for _ in range(4):
        core.step()
        core.check_integrity()
    core.abort_requests([str(i) for i in range(0, 6, 2)])
    core.check_integrity()
    for _ in range(3):
        core.step()
    core.abort_requests([str(i) for i in range(6)])
    while core.has_unfinished_requests():
        core.step()
    core.check_integrity()
    assert core.scheduler.kv_cache_manager.is_idle_clean()


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_cache_tokens", 0),
        ("max_cache_tokens", 2.5),
        ("compression_rate", 0.5),
        ("compression_rate", float("inf")),
        ("protected_window_size", -1),
        ("compress_once", "yes"),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_both_budgets_refused():
    with pytest.raises(ValueError, match="compression_rate"):
        SamplingParams(max_cache_tokens=8, compression_rate=2.0)


def test_fields_need_kvc_and_beam_search_is_refused(tiny_models):
    llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256)
    with pytest.raises(ValueError, match="max_cache_tokens.*enable_kvc"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_cache_tokens=8))
    llm.llm_engine.engine_core.check_integrity()
    kvc = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True)
    with pytest.raises(ValueError, match="beam search"):
        kvc.beam_search(
            [{"prompt_token_ids": [5, 6]}], BeamSearchParams(beam_width=2, max_tokens=4)
        )
    with pytest.raises(ValueError, match="kvc_method"):
        LLM(tiny_models("llama"), enable_kvc=True, kvc_method="best")


def test_compress_at_a_prefix_then_teacher_force(tiny_models):
    """The quality benchmark's teacher forcing, a planner attached through the KV seam
    (``benchmarks/kvc_probe.py``): the prefill stops at the prefix, evicts, and the rest of the
    prompt's logprobs see the compressed cache; with a budget above the prefix they equal the
    uncompressed run's."""
    from benchmarks.kvc_probe import measured_prefix

    prompt = _prompts()[5]  # 64 tokens: 48 of context, 16 to score

    def prompt_lps(at=None, **params):
        with measured_prefix():
            llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True)
        extra = {"compress_at": at} if at is not None else None
        sp = SamplingParams(
            temperature=0.0, max_tokens=1, prompt_logprobs=0, extra_args=extra, **params
        )
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        core = llm.llm_engine.engine_core
        core.check_integrity()
        lps = [next(iter(d.values())).logprob for d in out.prompt_logprobs[49:]]
        return lps, core.scheduler.kv_cache_manager.num_evicted_kvs

    full, evicted = prompt_lps()
    assert evicted == 0
    roomy, evicted = prompt_lps(at=48, max_cache_tokens=100)
    assert evicted == 0 and np.allclose(roomy, full, atol=1e-5)
    small, evicted = prompt_lps(at=48, max_cache_tokens=8, protected_window_size=4)
    assert evicted > 0 and not np.allclose(small, full, atol=1e-3)


def _tail(i: int) -> list[int]:
    """A 32-token suffix, different for each i."""
    return [(7 * i + 11 * j) % 400 + 3 for j in range(32)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefix_hit_without_eviction_equals_no_cache(arch, tiny_models):
    """Prefix caching with KV-Compress: prompts that share 48 tokens with an earlier one take
    its blocks in every (layer, head); with nothing evicted the tokens equal an engine's
    without the cache."""
    base = _prompts()[5]  # 64 tokens
    later = [base[:48] + _tail(i) for i in range(3)]
    # then in one batch: the later prompts hit blocks computed in the same step
    other = [x + 1 for x in base]
    batch = [other] + [other[:48] + _tail(i) for i in range(3, 6)]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    runs = {}
    for caching in (False, True):
        llm = LLM(tiny_models(arch), dtype="float32", max_model_len=256, enable_kvc=True,
                  enable_prefix_caching=caching)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": base}], sp, use_tqdm=False)
        for prompts in (later, batch):
            outs += llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        core = llm.llm_engine.engine_core
        core.check_integrity()
        runs[caching] = outs
        kv = core.scheduler.kv_cache_manager
        assert kv.enable_caching == caching and kv.is_idle_clean()
    assert [o.outputs[0].token_ids for o in runs[True]] == [
        o.outputs[0].token_ids for o in runs[False]
    ]
    assert [o.num_cached_tokens for o in runs[True]] == [0, 48, 48, 48] * 2
    assert all(o.num_cached_tokens == 0 for o in runs[False])


def test_shared_prefix_survives_the_evictions_of_its_sharers(tiny_models):
    """Four requests share a 48-token prefix and each evicts down to 8 KVs a head: the
    prefix's blocks are never evicted nor moved (their KVs sit outside every budget), so a
    later request that hits them (and evicts nothing: its tokens depend on their K and V
    only, not on the scores earlier holders left) decodes exactly as after a sharer that
    evicted nothing."""
    prefix = _prompts()[5][:48]
    probe = prefix + _tail(9)
    plain_probe = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    small = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, max_cache_tokens=8,
        protected_window_size=4,
    )  # fmt: skip

    from benchmarks.kvc_probe import measured_prefix  # (its planner logs every eviction)

    def probe_after(warm: list[list[int]], sp: SamplingParams):
        # random eviction: any unprotected KV may go, whatever the scores
        with measured_prefix():
            llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256,
                      enable_kvc=True, kvc_method="random")  # fmt: skip
        core = llm.llm_engine.engine_core
        kv = core.scheduler.kv_cache_manager
        log = core.scheduler.connectors[0].log
        llm.generate([{"prompt_token_ids": p} for p in warm], sp, use_tqdm=False)
        evicted = kv.num_evicted_kvs
        heads = int(kv.compressible.sum())
        # evictions happened, and never below the shared prefix (48 KVs in every head)
        assert bool(log) == (evicted > 0)
        if log:
            assert min(after for _, _, after in log) >= 48 * heads
            assert any(after < before for _, before, after in log)
        out = llm.generate([{"prompt_token_ids": probe}], plain_probe, use_tqdm=False)[0]
        core.check_integrity()
        assert kv.is_idle_clean()
        return out, evicted

    got, evicted = probe_after([prefix + _tail(i) for i in range(4)], small)
    assert evicted > 0
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    want, evicted = probe_after([prefix + _tail(0)], plain)
    assert evicted == 0
    assert got.num_cached_tokens == want.num_cached_tokens == 48
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_prompt_prefix_outlives_its_requests_eviction(tiny_models):
    """Requests one at a time, each evicting after its prompt: the first one moves to copies
    of its cached prompt blocks before its eviction, so they stay cached; the next request
    with the same prefix hits them and decodes (without eviction) exactly as after a request
    that evicted nothing, and the evicting request's tokens are those of an engine without
    the cache."""
    prefix = _prompts()[5][:48]
    first, probe = prefix + _tail(1), prefix + _tail(9)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    small = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, max_cache_tokens=8,
        protected_window_size=4,
    )  # fmt: skip

    def one_then_probe(caching: bool, sp: SamplingParams):
        llm = LLM(tiny_models("llama"), dtype="float32", max_model_len=256, enable_kvc=True,
                  enable_prefix_caching=caching)  # fmt: skip
        a = llm.generate([{"prompt_token_ids": first}], sp, use_tqdm=False)[0]
        b = llm.generate([{"prompt_token_ids": probe}], plain, use_tqdm=False)[0]
        core = llm.llm_engine.engine_core
        core.check_integrity()
        kv = core.scheduler.kv_cache_manager
        assert kv.is_idle_clean()
        return a, b, kv

    a, b, kv = one_then_probe(True, small)
    assert kv.num_prefix_copies > 0 and kv.num_evicted_kvs > 0
    a_ref, _, kv_ref = one_then_probe(False, small)
    assert kv_ref.num_prefix_copies == 0
    assert a.outputs[0].token_ids == a_ref.outputs[0].token_ids
    _, b_ref, _ = one_then_probe(True, SamplingParams(temperature=0.0, max_tokens=1))
    assert b.num_cached_tokens == b_ref.num_cached_tokens == 48
    assert b.outputs[0].token_ids == b_ref.outputs[0].token_ids


def test_cli_flags():
    from pagedllm.config import engine_args_from
    from pagedllm.entrypoints.cli import build_parser

    ns = build_parser().parse_args(
        ["serve", "m", "--enable-kvcompress", "--compression-rate", "8", "--kvc-method",
         "uniform", "--no-maxpool-metrics", "--protected-window-size", "16"]
    )  # fmt: skip
    args = engine_args_from(ns)
    assert args.enable_kvc and args.compression_rate == 8.0 and args.kvc_method == "uniform"
    assert args.maxpool_metrics is False and args.protected_window_size == 16
