"""The server's engine front ends on a tiny random model: ``AsyncLLM`` (the engine on a thread
of this process) and ``MPAsyncLLM`` (an engine core process), the same tests for both:
streaming, validation, abort, failures, idle."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest

from pagedllm.engine.async_llm import AsyncLLM, AsyncLLMBase, EngineDeadError, EngineError
from pagedllm.engine.mp_async_llm import MPAsyncLLM
from pagedllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _args(tiny_models, **kw):  # noqa: ANN001, ANN202
    from pagedllm.config import EngineArgs

    kw = {"max_model_len": 128, "num_gpu_blocks_override": 64, **kw}
    return EngineArgs(model=tiny_models("llama"), dtype="float32", device="cpu", **kw)


@pytest.fixture(scope="module", params=["thread", "process"])
def llm(request, tiny_models) -> Iterator[AsyncLLMBase]:  # noqa: ANN001
    cls = AsyncLLM if request.param == "thread" else MPAsyncLLM
    engine = cls.from_engine_args(_args(tiny_models))
    yield engine
    engine.shutdown()


def core_idle(core):  # noqa: ANN001, ANN201 - runs in the engine core process
    """KV invariants hold and every block is free: (free blocks, blocks)."""
    core.check_integrity()
    kv = core.scheduler.kv_cache_manager
    return kv.num_free_blocks(), kv.num_blocks


def fail_next_step(core) -> None:  # noqa: ANN001 - runs in the engine core process
    """The next step that runs the model raises RuntimeError("boom") (in the runner, after
    scheduling: its requests are in the failed step); later ones run normally."""
    runner = core.model_runner

    def flaky(scheduler_output):  # noqa: ANN001, ANN202
        del runner.launch_forward  # back to the class method
        raise RuntimeError("boom")

    runner.launch_forward = flaky


def _idle_ok(llm: AsyncLLMBase) -> None:
    """On the engine loop (so after every earlier iteration): no request tracked, every
    block free, KV invariants hold."""

    async def check() -> tuple[int, int, int]:
        if isinstance(llm, MPAsyncLLM):
            free, total = await llm.call_in_core(core_idle)
            return len(llm._streams), free, total
        return await llm.call_in_engine(lambda e: (len(llm._streams), *core_idle(e.engine_core)))

    streams, free, total = asyncio.run(check())
    assert streams == 0 and free == total


async def _collect(llm: AsyncLLMBase, prompt: str, params: SamplingParams = GREEDY) -> list:
    return [out async for out in llm.generate(prompt, params)]


def test_generate_streams_deltas(llm: AsyncLLMBase) -> None:
    outs = asyncio.run(_collect(llm, "Hello there"))
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(tokens) == 8 and outs[-1].outputs[0].finish_reason == "length"
    again = asyncio.run(_collect(llm, "Hello there"))
    assert [t for o in again for t in o.outputs[0].token_ids] == tokens  # greedy: same
    _idle_ok(llm)


def test_many_concurrent_requests(llm: AsyncLLMBase) -> None:
    async def run() -> list[list]:
        return await asyncio.gather(*(_collect(llm, f"prompt {i}") for i in range(12)))

    results = asyncio.run(run())
    assert all(sum(len(o.outputs[0].token_ids) for o in r) == 8 for r in results)
    _idle_ok(llm)


def test_validation_error_before_streaming(llm: AsyncLLMBase) -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="prompt"):
            await llm.add_request("", GREEDY)
        with pytest.raises(ValueError, match="max_model_len"):
            await llm.add_request(list(range(3, 200)), GREEDY)
        gen = llm.generate([10**6], GREEDY)
        with pytest.raises(ValueError, match="vocab"):
            await gen.__anext__()
        # 100 tokens: still running when the duplicate comes (8 could finish before it)
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        stream = await llm.add_request("ok", long, request_id="dup")
        with pytest.raises(ValueError, match="already in use"):
            await llm.add_request("ok", GREEDY, request_id="dup")
        assert [o async for o in stream][-1].finished

    asyncio.run(run())
    _idle_ok(llm)


def test_abort_and_close_free_blocks(llm: AsyncLLMBase) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def run() -> None:
        stream = await llm.add_request("abort me", long, request_id="a1")
        await stream.__anext__()
        await llm.abort("a1")
        rest = [o async for o in stream]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        gen = llm.generate("close me", long)
        await gen.__anext__()
        await gen.aclose()  # the consumer walks away: the request is aborted

    asyncio.run(run())
    _idle_ok(llm)


def test_engine_failure_is_reported_and_survived(llm: AsyncLLMBase) -> None:
    """A step that raises fails the requests in flight (EngineError), not the engine."""
    if isinstance(llm, MPAsyncLLM):
        asyncio.run(llm.call_in_core(fail_next_step))
    else:
        assert isinstance(llm, AsyncLLM)
        fail_next_step(llm.engine.engine_core)  # the engine thread is idle
    with pytest.raises(EngineError, match="boom"):
        asyncio.run(_collect(llm, "this one fails"))
    assert llm.is_running
    outs = asyncio.run(_collect(llm, "this one works"))
    assert outs[-1].finished
    _idle_ok(llm)


def test_parallel_sampling_deltas_best_of_and_beam(llm: AsyncLLMBase) -> None:
    """n > 1 streams deltas tagged with their sequence index; output_kind "final" with
    best_of > n ends with the n best re-indexed; a beam search ends with one output holding
    the hypotheses, best first; a cache_salt rides along; nothing leaks."""
    from pagedllm.beam_search import BeamSearchParams

    prompt = {"prompt_token_ids": [5, 6, 7, 8]}

    async def run() -> None:
        params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True)
        outs = [o async for o in await llm.add_request(prompt, params)]
        per_seq: dict[int, list[int]] = {}
        for o in outs:
            assert len({c.index for c in o.outputs}) == len(o.outputs)
            for c in o.outputs:
                per_seq.setdefault(c.index, []).extend(c.token_ids)
        assert sorted(per_seq) == [0, 1, 2] and all(len(t) == 6 for t in per_seq.values())
        best = SamplingParams(n=2, best_of=4, temperature=1.0, seed=4, max_tokens=5)
        finals = [o async for o in await llm.add_request(prompt, best, output_kind="final")]
        assert len(finals) == 1 and [c.index for c in finals[0].outputs] == [0, 1]
        lps = [c.cumulative_logprob for c in finals[0].outputs]
        assert lps == sorted(lps, reverse=True)
        beam = await llm.add_beam_request(prompt, BeamSearchParams(beam_width=3, max_tokens=4))
        (result,) = [o async for o in beam]
        assert result.finished and [c.index for c in result.outputs] == [0, 1, 2]
        salted = {**prompt, "cache_salt": "s"}
        assert [o async for o in await llm.add_request(salted, GREEDY)][-1].finished
        with pytest.raises(ValueError, match="cache_salt"):
            await llm.add_request({**prompt, "cache_salt": 3}, GREEDY)
        with pytest.raises(ValueError, match="output_kind"):
            await llm.add_request(prompt, GREEDY, output_kind="cumulative")

    asyncio.run(run())
    _idle_ok(llm)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_idle_engine_loop_sleeps(llm: AsyncLLMBase) -> None:
    """An idle engine (thread, or core process) takes no CPU: it waits, it does not poll."""
    if isinstance(llm, MPAsyncLLM):
        stat = f"/proc/{llm.core.pid}/stat"
    else:
        assert isinstance(llm, AsyncLLM)
        stat = f"/proc/self/task/{llm._thread.native_id}/stat"

    def cpu_ticks() -> int:
        with open(stat) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    before = cpu_ticks()
    time.sleep(0.5)
    assert cpu_ticks() - before <= 2  # a busy loop would burn ~50 ticks


@pytest.mark.parametrize("cls", [AsyncLLM, MPAsyncLLM])
def test_shutdown(tiny_models, cls: type[AsyncLLMBase]) -> None:  # noqa: ANN001
    llm = cls.from_engine_args(_args(tiny_models, max_model_len=64, num_gpu_blocks_override=16))
    llm.shutdown()
    assert not llm.is_running
    if isinstance(llm, AsyncLLM):
        assert not llm._thread.is_alive()
    else:
        assert isinstance(llm, MPAsyncLLM) and llm.core.exit_code() == 0
    with pytest.raises(EngineDeadError):
        asyncio.run(llm.add_request("hi", GREEDY))
