"""Async scheduling (step N+1 launched before step N's tokens reach the host) gives the same
tokens, logprobs and finish reasons as synchronous steps, under chunked prefill, preemption,
prefix caching, stops and aborts, and really runs launch N+1 before resolving N."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from tests.models.tiny import hf_greedy


def _llm(path: str, asynch: bool, **kw) -> LLM:
    return LLM(path, dtype="float32", max_model_len=256, async_scheduling=asynch, **kw)


def _run(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.engine_core.check_integrity()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs]


def _prompts(n: int, seed: int, lo: int = 2, hi: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(k)).tolist() for k in rng.integers(lo, hi, size=n)]


def test_async_steps_overlap_launch_and_resolve(tiny_models):
    """The order of runner calls is launch(1), launch(2), resolve(1), launch(3), resolve(2)...:
    the next step is queued before the last one's tokens are read."""
    llm = _llm(tiny_models("llama"), True)
    runner = llm.llm_engine.engine_core.model_runner
    calls: list[str] = []
    launch, resolve = runner.launch_forward, runner.resolve

    def logged_launch(so):  # noqa: ANN001, ANN202
        step = launch(so)
        calls.append(f"L{id(step)}")
        return step

    def logged_resolve(step):  # noqa: ANN001, ANN202
        calls.append(f"R{id(step)}")
        return resolve(step)

    runner.launch_forward, runner.resolve = logged_launch, logged_resolve
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    _run(llm, _prompts(3, 0), params)
    kinds = [c[0] for c in calls]
    assert kinds[:4] == ["L", "L", "R", "L"]
    # every launched step is resolved exactly once, after the next one was launched
    launched = [c[1:] for c in calls if c[0] == "L"]
    resolved = [c[1:] for c in calls if c[0] == "R"]
    assert sorted(launched) == sorted(resolved)
    for i, c in enumerate(calls):
        if c[0] == "R" and i + 1 < len(calls):
            assert calls.index("L" + c[1:]) < i - 1


def test_offline_outputs_are_processed_while_the_next_step_runs(tiny_models):
    """LLM.generate under async scheduling detokenizes step N's outputs after step N+1 is
    queued and before N+1's tokens are awaited (LLMEngine.defer_outputs); with stop strings
    (found one step later, so the sequence runs one more step), max_tokens and EOS the texts,
    tokens and finish reasons are those without the deferral and those of sync steps, and no
    block is left behind."""
    path = tiny_models("qwen3")
    prompts = _prompts(10, 4)
    llm = _llm(path, True, max_num_batched_tokens=32)
    engine = llm.llm_engine
    assert engine.defer_outputs
    free = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in prompts]
    texts = [t for _, _, t in _run(llm, prompts, free)]
    # odd requests stop at a character their unstopped text has after its third
    stops = [next((c for c in t[3:] if c.isprintable()), None) for t in texts]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=i % 3 == 0,
                       stop=[stops[i]] if i % 2 and stops[i] else None)
        for i in range(len(prompts))
    ]  # fmt: skip
    runner = engine.engine_core.model_runner
    calls: list[str] = []
    launch, resolve = runner.launch_forward, runner.resolve
    process = engine.output_processor.process_outputs

    def logged(tag, fn):  # noqa: ANN001, ANN202
        def call(*a):  # noqa: ANN002, ANN202
            calls.append(tag)
            return fn(*a)

        return call

    runner.launch_forward, runner.resolve = logged("L", launch), logged("R", resolve)
    engine.output_processor.process_outputs = logged("P", process)
    deferred = _run(llm, prompts, params)
    assert "LPR" in "".join(calls)  # processing between a launch and the next resolve
    assert sum(t != d[2] and d[1] == "stop" for t, d in zip(texts, deferred)) >= 2
    engine.defer_outputs = False
    assert _run(llm, prompts, params) == deferred
    assert _run(_llm(path, False), prompts, params) == deferred


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_async_greedy_equals_hf_and_sync(arch, tiny_models):
    path = tiny_models(arch)
    prompts = _prompts(8, 1)
    ref, _ = hf_greedy(path, prompts, 12)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = _run(_llm(path, True, max_num_batched_tokens=32), prompts, params)
    assert [g[0] for g in got] == ref


def test_async_matches_sync_with_mixed_lengths_stops_and_logprobs(tiny_models):
    """Requests finish at different steps (max_tokens 1..16, EOS, a stop string) so finished
    requests sit in the in-flight step; logprobs and text are the same as synchronous."""
    path = tiny_models("qwen3")
    prompts = _prompts(12, 2)
    params = [
        SamplingParams(
            temperature=0 if i % 3 else 1.0,
            seed=i,
            max_tokens=1 + (i * 5) % 16,
            ignore_eos=i % 2 == 0,
            logprobs=2 if i % 4 == 0 else None,
            stop=["e"] if i == 5 else None,
        )
        for i in range(len(prompts))
    ]
    sync = _run(_llm(path, False, max_num_batched_tokens=24), prompts, params)
    asyn = _run(_llm(path, True, max_num_batched_tokens=24), prompts, params)
    assert asyn == sync
    llm_s, llm_a = _llm(path, False), _llm(path, True)
    lp_s = llm_s.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    lp_a = llm_a.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(lp_s, lp_a):  # batches differ by step, so float sums differ slightly
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert (la is None) == (lb is None)
        for pa, pb in zip(la or [], lb or []):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert pa[t].rank == pb[t].rank
                assert pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_preemption_keeps_outputs(mode, tiny_models):
    """A request preempted while its last token is still in flight resumes with that token."""
    path = tiny_models("llama")
    prompts = _prompts(6, 5, 38, 42)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = _run(_llm(path, False), prompts, greedy)
    kw = dict(
        block_size=8, num_gpu_blocks_override=12, preemption_mode=mode, enable_prefix_caching=False
    )
    if mode == "swap":
        kw["swap_space"] = 0.01
    llm = _llm(path, True, **kw)
    got = _run(llm, prompts, greedy)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert got == ref


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_request_finishing_while_preempted(mode, tiny_models):
    """A request preempted (recompute or swap) while the step with its last token is still in flight
    finishes from the waiting queue when that step resolves: the tokens are the synchronous
    run's, and no block or request is left behind (found on a GPU, where async scheduling is
    the default: the scheduler assumed a finishing request was running)."""
    path = tiny_models("llama")
    rng = np.random.default_rng(7)
    prompts = []
    for i in range(6):
        phrase = rng.integers(3, 500, int(rng.integers(5, 14))).tolist()
        prompts.append(phrase * 3 + phrase[: i + 1])
    greedy = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    kw = dict(block_size=8, num_gpu_blocks_override=16, preemption_mode=mode,
              enable_prefix_caching=False)  # fmt: skip
    if mode == "swap":
        kw["swap_space"] = 0.01
    ref = _run(_llm(path, False, **kw), prompts, greedy)
    llm = _llm(path, True, **kw)
    sched = llm.llm_engine.engine_core.scheduler
    seen = []
    emit = sched._emit

    def spy(request, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(request.is_finished and request not in sched.running)
        return emit(request, *a, **k)

    sched._emit = spy
    assert _run(llm, prompts, greedy) == ref
    assert any(seen), "no request finished while preempted: the case did not occur"
    assert not sched.waiting and not sched.running and not sched.requests  # _run checked blocks


def test_async_prefix_caching_and_priority_policy(tiny_models):
    path = tiny_models("llama")
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, 500, size=40).tolist()
    prompts = [prefix + rng.integers(3, 500, size=int(k)).tolist() for k in range(1, 9)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = _run(_llm(path, False, enable_prefix_caching=False), prompts, greedy)
    llm = _llm(
        path,
        True,
        scheduling_policy="priority",
        max_num_seqs=3,
        num_gpu_blocks_override=20,
        block_size=8,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        greedy,
        use_tqdm=False,
        priority=[i % 3 for i in range(len(prompts))],
    )
    assert [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text) for o in outs
    ] == ref
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_cache_hits > 0
    llm.llm_engine.engine_core.check_integrity()


def test_async_switches_to_sync_for_requests_that_need_host_tokens(tiny_models):
    """Penalties and n > 1 need every token on the host before the next step: with such a
    request in the batch the engine runs synchronously, and everyone's outputs stay right."""
    path = tiny_models("llama")
    prompts = _prompts(6, 8)
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) for _ in prompts]
    params[2] = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    params[4] = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8, ignore_eos=True)
    sync_llm, async_llm = _llm(path, False), _llm(path, True)
    a = sync_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    b = async_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [
        [c.token_ids for c in o.outputs] for o in b
    ]
    async_llm.llm_engine.engine_core.check_integrity()


def test_async_abort_in_flight_leaves_others_intact(tiny_models):
    path = tiny_models("llama")
    prompts = _prompts(4, 9)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = _run(_llm(path, False), prompts, greedy)
    llm = _llm(path, True)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, greedy)
    finished: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 4:  # request 1's step is in flight now
            engine.abort_request("1")
    assert "1" not in finished or finished["1"] != ref[1][0]
    for i in (0, 2, 3):
        assert finished[str(i)] == ref[i][0]
    engine.engine_core.check_integrity()


@pytest.mark.parametrize("process", [False, True], ids=["local", "process"])
def test_async_grammars_fill_the_mask_after_the_forward_is_queued(process, tiny_models):
    """Grammar-constrained requests keep async scheduling: step N's forward is queued, then
    step N-1 resolved (its tokens advance the matchers and step N's bitmask is filled, in the
    worker process with ``process``), and step N's sampling is queued when the next step
    collects the bitmask; texts equal synchronous steps and parse."""
    import json

    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    from pagedllm.structured_output.params import StructuredOutputsParams
    from tests.engine.test_structured_outputs import SMALL_OBJECT as schema

    path = tiny_models("llama")
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=30,
            structured_outputs=StructuredOutputsParams(json=schema) if i % 2 else None,
        )
        for i in range(6)
    ]
    prompts = [list(range(10 + i, 50 + i)) for i in range(6)]
    sync = _run(_llm(path, False), prompts, params)
    llm = _llm(path, True, grammar_process=process)
    runner = llm.llm_engine.engine_core.model_runner
    calls: list[str] = []
    for name, tag in (("launch_forward", "F"), ("resolve", "R"), ("launch_sample", "S")):
        fn = getattr(runner, name)

        def logged(*a, fn=fn, tag=tag):  # noqa: ANN002, ANN202
            calls.append(tag)
            return fn(*a)

        setattr(runner, name, logged)
    got = _run(llm, prompts, params)
    assert got == sync
    assert "FRS" in "".join(calls)  # forward N, resolve N-1, then the grammar step's sampling
    for (_, reason, text), p in zip(got, params):
        if p.structured_outputs is not None and reason == "stop":
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("process", [False, True], ids=["local", "process"])
def test_grammar_request_running_async_then_a_request_that_needs_sync_steps(process, tiny_models):
    """A grammar request decoding under async scheduling (a step in flight); a penalties
    request arriving switches the engine to synchronous steps, which must first resolve the
    step in flight. Both requests finish as they do alone."""
    from pagedllm.structured_output.params import StructuredOutputsParams
    from tests.engine.test_structured_outputs import SMALL_OBJECT as schema

    path = tiny_models("llama")
    grammar = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(json=schema)
    )
    penalty = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3)
    g_prompt, p_prompt = _prompts(2, 11)
    alone = [
        _run(_llm(path, False), [g_prompt], grammar),
        _run(_llm(path, False), [p_prompt], penalty),
    ]
    engine = _llm(path, True, grammar_process=process).llm_engine
    engine.add_request("g", {"prompt_token_ids": g_prompt}, grammar)
    finished: dict[str, list[int]] = {}
    added = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        # (the grammar compiles first: the request waits for it a few steps)
        core = engine.engine_core
        if not added and core._pending is not None and core._pending[0].structured_requests:
            engine.add_request("p", {"prompt_token_ids": p_prompt}, penalty)
            added = True
    assert added
    assert finished["g"] == alone[0][0][0]
    assert finished["p"] == alone[1][0][0]
    engine.engine_core.check_integrity()
