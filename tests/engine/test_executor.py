"""The executor seam: the multiprocess executor ("mp", the model in a worker process) gives
the same tokens as the in-process one ("uni") under synchronous and async scheduling, with
parallel sampling, logprobs and grammars; a dead or failing worker raises instead of
hanging; shutdown (or a forgotten engine) leaves no process behind."""

from __future__ import annotations

import gc
import importlib.util
import os
import pickle
import signal

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import EngineArgs, ParallelConfig
from pagedllm.utils.child import process_alive


def _llm(path: str, backend: str, asynch: bool = False, **kw) -> LLM:
    return LLM(
        path,
        dtype="float32",
        max_model_len=256,
        async_scheduling=asynch,
        distributed_executor_backend=backend,
        **kw,
    )


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=int(k)).tolist() for k in rng.integers(2, 60, size=n)]


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.engine_core.check_integrity()
    return [
        [
            (c.token_ids, c.finish_reason, c.logprobs and [sorted(d) for d in c.logprobs])
            for c in o.outputs
        ]
        for o in outs
    ]


def _children() -> set[int]:
    """Live processes whose parent is this one."""
    me, kids = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[1]) == me:
            kids.add(int(entry))
    return kids


@pytest.mark.parametrize("asynch", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: the hybrid KV cache's groups
def test_mp_tokens_equal_uni(asynch, arch, tiny_models):
    """Greedy requests (prefills chunked by a small token budget), one with logprobs and one
    with n=2 seeded sampling: the same tokens, finish reasons and logprobs either way."""
    path = tiny_models(arch)
    prompts = _prompts(6, 0)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    params[3] = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=7, ignore_eos=True)
    results = {}
    for backend in ("uni", "mp"):
        llm = _llm(path, backend, asynch, max_num_batched_tokens=48)
        results[backend] = _run(llm, prompts, params)
        llm.llm_engine.engine_core.shutdown()
    assert results["mp"] == results["uni"]
    assert len(results["mp"][3]) == 2


def _recording(fn, seen: list):  # noqa: ANN001, ANN202
    def call(*args):  # noqa: ANN002, ANN202
        out = fn(*args)
        seen.extend(x for x in (*args, out) if x is not None)
        return out

    return call


def test_what_crosses_the_executor_pickles_unchanged(tiny_models):
    """Every plan and result of a run with new, cached, chunked, forked, penalised, logprob
    and beam-search requests (and grammar bitmasks, with xgrammar) survives pickling."""
    import torch

    from pagedllm.beam_search import BeamSearchParams

    llm = _llm(tiny_models("llama"), "uni", max_num_batched_tokens=48)
    executor = llm.llm_engine.engine_core.executor
    seen: list = []
    for name in ("execute_model", "launch_forward", "launch_sample", "resolve"):
        setattr(executor, name, _recording(getattr(executor, name), seen))
    prompts = _prompts(5, 3)
    params = [
        SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1, logprobs=2),
        SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=5),
        SamplingParams(temperature=0.7, max_tokens=5, repetition_penalty=1.3, stop=["x"]),
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0, max_tokens=5),
    ]
    if importlib.util.find_spec("xgrammar") is not None:
        from pagedllm.structured_output.params import StructuredOutputsParams

        params[3].structured_outputs = StructuredOutputsParams(regex="[ab]+")
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.beam_search(
        [{"prompt_token_ids": prompts[0]}], BeamSearchParams(beam_width=2, max_tokens=4)
    )
    kinds = set()
    for obj in seen:
        if type(obj).__name__ == "LaunchedStep":
            continue  # the in-process handle (the "mp" handle is an int)
        kinds.add(type(obj).__name__)
        back = pickle.loads(pickle.dumps(obj))
        if type(obj).__name__ == "GrammarStep":
            assert back.fill_ids == obj.fill_ids and torch.equal(back.mask, obj.mask)
        else:
            assert back == obj
        if type(obj).__name__ == "SchedulerOutput":  # the runner reads the tuples
            assert back.cached_rows() == obj.cached_rows()
    assert {"SchedulerOutput", "ModelRunnerOutput"} <= kinds
    assert ("GrammarStep" in kinds) == (params[3].structured_outputs is not None)


@pytest.mark.skipif(importlib.util.find_spec("xgrammar") is None, reason="needs xgrammar")
@pytest.mark.parametrize("asynch", [False, True], ids=["sync", "async"])
def test_mp_structured_request_equals_uni(asynch, tiny_models):
    """A grammar's bitmask reaches the worker's sampling: constrained texts are the same."""
    from pagedllm.structured_output.params import StructuredOutputsParams

    path = tiny_models("llama")
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=8, structured_outputs=choice)
        if i % 2
        else SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        for i in range(4)
    ]
    prompts = _prompts(4, 1)
    texts = {}
    for backend in ("uni", "mp"):
        llm = _llm(path, backend, asynch)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        texts[backend] = [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]
        llm.llm_engine.engine_core.shutdown()
    assert texts["mp"] == texts["uni"]
    assert all(texts["mp"][i][0] in ("yes", "no", "maybe") for i in (1, 3))


def test_kv_cache_groups_and_start_up_answers_match(tiny_models):
    path = tiny_models("gemma3")
    uni, mp = _llm(path, "uni"), _llm(path, "mp")
    try:
        a, b = uni.llm_engine.engine_core, mp.llm_engine.engine_core
        assert pickle.dumps(b.executor.kv_cache_groups()) == pickle.dumps(
            a.executor.kv_cache_groups()
        )
        assert b.num_blocks == a.num_blocks
        assert (b.executor.device_type, b.executor.max_num_reqs) == (
            a.executor.device_type,
            a.executor.max_num_reqs,
        )
        with pytest.raises(RuntimeError, match="distributed_executor_backend='uni'"):
            _ = b.model_runner
    finally:
        mp.llm_engine.engine_core.shutdown()


def test_killed_worker_raises_naming_it(tiny_models):
    """SIGKILL the worker mid-generation: the engine raises a RuntimeError naming the worker
    (rank, pid, exit code) rather than waiting for it, and says so again on the next call."""
    llm = _llm(tiny_models("llama"), "mp", asynch=True)
    core = llm.llm_engine.engine_core
    executor = core.executor
    pid = executor.pids[0]
    launch = executor.launch_step  # an async step without grammars: forward + sample
    calls = []

    def launch_then_kill(so):  # noqa: ANN001, ANN202
        calls.append(1)
        if len(calls) == 3:
            os.kill(pid, signal.SIGKILL)
        return launch(so)

    executor.launch_step = launch_then_kill
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    with pytest.raises(RuntimeError, match=rf"worker rank 0 \(pid {pid}\) died \(exit code -9\)"):
        llm.generate([{"prompt_token_ids": p} for p in _prompts(3, 2)], params, use_tqdm=False)
    with pytest.raises(RuntimeError, match="broken"):
        executor.resolve(0)
    core.shutdown()
    assert not process_alive(pid)


def test_worker_exception_comes_back_with_its_traceback(tiny_models):
    llm = _llm(tiny_models("llama"), "mp")
    executor = llm.llm_engine.engine_core.executor
    with pytest.raises(RuntimeError, match=r"(?s)worker rank 0 .* failed:\nTraceback.*KeyError"):
        executor.resolve(12345)  # a step the worker never launched
    llm.llm_engine.engine_core.shutdown()


def test_shutdown_and_a_forgotten_engine_leave_no_process(tiny_models):
    path = tiny_models("llama")
    llm = _llm(path, "mp")
    pids = llm.llm_engine.engine_core.executor.pids
    assert pids and all(process_alive(p) for p in pids) and set(pids) <= _children()
    llm.llm_engine.engine_core.shutdown()
    llm.llm_engine.engine_core.shutdown()  # twice is fine
    assert not any(process_alive(p) for p in pids) and not set(pids) & _children()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.llm_engine.engine_core.executor.resolve(0)

    llm = _llm(path, "mp")  # never shut down: the finalizer stops the worker
    pids = llm.llm_engine.engine_core.executor.pids
    del llm
    gc.collect()
    assert not any(process_alive(p) for p in pids) and not set(pids) & _children()


def test_bad_backend_is_a_value_error_naming_the_field(tiny_models):
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        ParallelConfig(distributed_executor_backend="dask")
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineArgs(
            model=tiny_models("llama"), distributed_executor_backend="thread"
        ).create_engine_config()
    from pagedllm.config import engine_args_from
    from pagedllm.entrypoints.cli import build_parser

    ns = build_parser().parse_args(["serve", "m", "--distributed-executor-backend", "ray"])
    assert engine_args_from(ns).distributed_executor_backend == "ray"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--distributed-executor-backend", "bogus"])


def test_a_plan_pickles_again_after_crossing() -> None:
    """A plan that crossed once (cached requests as tuples, not expanded) pickles again - as a
    Ray actor or a relaying process would - and expands to the same requests."""
    from pagedllm.core.sched.output import CachedRequestData, SchedulerOutput

    cached = [CachedRequestData("a", ([3],), 17), CachedRequestData("b", (), 5, [(0, 1, 9)], [4])]
    so = SchedulerOutput([], cached, {"a": 1, "b": 1}, 2)
    once = pickle.loads(pickle.dumps(so))
    twice = pickle.loads(pickle.dumps(once))
    assert "scheduled_cached_reqs" not in vars(twice)  # still the tuples
    assert twice.cached_rows() == so.cached_rows()
    assert twice.scheduled_cached_reqs == cached and twice == so
