"""Data parallelism behind one server (issue 20): ``--data-parallel-size 2`` runs two engine
core processes behind one front end. The same greedy completions as one core; the load is
spread (per-core request counts) and requests sharing a prefix go to the core that has it
cached; ``/metrics`` sums the cores; a core that dies fails only its own requests, the other
serves on, and ``/health`` turns 503 only when none is left.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pagedllm.engine.dp_async_llm import AFFINITY_SLACK, DPAsyncLLM, DPRouter
from pagedllm.engine.mp_async_llm import MPAsyncLLM
from pagedllm.sampling_params import SamplingParams

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.server.test_faults import HEADERS, Live, serve  # noqa: E402


def _args(path: str, dp: int) -> Any:
    from pagedllm.config import EngineArgs

    return EngineArgs(model=path, dtype="float32", device="cpu", seed=0, max_model_len=512,
                      num_gpu_blocks_override=160, data_parallel_size=dp)  # fmt: skip


@pytest.fixture(scope="module")
def dp(tiny_models) -> Iterator[Live]:  # noqa: ANN001
    llm = DPAsyncLLM.from_engine_args(_args(tiny_models("llama"), 2))
    with serve(llm) as srv:
        yield srv


def _metrics(text: str) -> dict[str, float]:
    """name (labels dropped) -> value of a Prometheus text page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def _one_engine(path: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """The texts one in-process engine (same arguments, data_parallel_size 1) completes."""
    from pagedllm import LLM

    llm = LLM(path, dtype="float32", device="cpu", seed=0, max_model_len=512,
              num_gpu_blocks_override=160)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _complete(srv: Live, prompt: list[int], max_tokens: int = 10) -> dict:
    r = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                     "temperature": 0, "ignore_eos": True})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


async def _many(srv: Live, prompts: list[list[int]]) -> list[dict]:
    async with httpx.AsyncClient(timeout=60) as client:
        body = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
        rs = await asyncio.gather(*(
            client.post(srv.url + "/v1/completions", json={**body, "prompt": p},
                        headers=HEADERS) for p in prompts
        ))  # fmt: skip
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [r.json() for r in rs]


def test_router_rule() -> None:
    r = DPRouter(2, block_size=4)
    a, b = [1, 2, 3, 4, 9], [5, 6, 7, 8]
    assert r.key([1, 2, 3], None) is None  # shorter than a block: load alone
    assert r.pick(r.key(a, None), [0, 0], [True, True]) == 0  # least loaded, lowest index
    assert r.pick(r.key(b, None), [1, 0], [True, True]) == 1
    # the same first block goes back to its core while it is not too far behind
    assert r.pick(r.key(a + [7], None), [AFFINITY_SLACK, 0], [True, True]) == 0
    assert r.pick(r.key(a, None), [AFFINITY_SLACK + 1, 0], [True, True]) == 1  # load wins
    assert r.pick(r.key(a, "tenant"), [0, 5], [True, True]) == 0  # another salt: another key
    assert r.pick(r.key(b, None), [0, 0], [True, False]) == 0  # a dead core gets nothing
    assert r.routed == [4, 2] and r.by_affinity == 1


def test_same_outputs_spread_and_affinity(dp: Live, tiny_models) -> None:  # noqa: ANN001
    prompts = [[10 + i, 20 + i, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160,
                170 + i] for i in range(8)]  # fmt: skip
    got = asyncio.run(_many(dp, prompts))
    assert [g["choices"][0]["text"] for g in got] == _one_engine(tiny_models("llama"), prompts, 10)
    llm = dp.llm
    assert isinstance(llm, DPAsyncLLM)
    routed = llm.router.routed
    assert all(n > 0 for n in routed), routed  # both cores served
    # two requests with the first prompt's first block: sent where that prompt went
    before = list(routed)
    shared = prompts[0][:16]
    _complete(dp, shared + [1, 2, 3])
    _complete(dp, shared + [4, 5])
    moved = [a - b for a, b in zip(llm.router.routed, before)]
    assert sorted(moved) == [0, 2], moved
    assert llm.router.by_affinity >= 2
    # /metrics: the cores' gauges summed, and every completion's tokens counted once
    text = httpx.get(dp.url + "/metrics", timeout=30).text
    values = _metrics(text)
    assert values["pagedllm:kv_cache_total_blocks"] == sum(c.num_blocks for c in llm.cores)
    assert values["vllm:generation_tokens_total"] == 10 * (len(prompts) + 2)
    assert llm.stats()["dp_live_cores"] == 2
    # the dashboard: core 0's pool (its prompts' blocks cached), the two cores counted
    state = httpx.get(dp.url + "/dashboard/state", headers=HEADERS, timeout=30).json()
    snap = state["snapshot"]
    assert snap["cores"] == 2 and snap["blocks"]["total"] == llm.cores[0].num_blocks
    assert snap["blocks"]["counts"]["cached"] > 0 and snap["requests"] == []


def test_dead_core_fails_its_own_requests_only(tiny_models) -> None:  # noqa: ANN001
    llm = DPAsyncLLM.from_engine_args(_args(tiny_models("llama"), 2))
    try:
        with serve(llm) as srv:
            victim = llm.cores[1]

            async def run() -> None:
                long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
                streams = [await llm.add_request({"prompt_token_ids": [7 + i] * 3}, long)
                           for i in range(4)]  # fmt: skip
                assert {c.num_unfinished for c in llm.cores} == {2}  # two on each core
                for s in streams:
                    await s.__anext__()
                os.kill(victim.core.pid, signal.SIGKILL)
                errors = 0
                for s in streams:
                    try:
                        async for _ in s:
                            pass
                    except Exception as e:  # noqa: BLE001
                        errors += 1
                        assert "exit code -9" in str(e)
                assert errors == 2

            asyncio.run_coroutine_threadsafe(run(), srv.loop).result(120)
            # the other core serves on; /health stays 200 while one is alive
            assert _complete(srv, [1, 2, 3, 4])["choices"][0]["text"]
            assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
            assert llm.stats()["dp_live_cores"] == 1
            os.kill(llm.cores[0].core.pid, signal.SIGKILL)
            for _ in range(100):
                if not llm.is_running:
                    break
                asyncio.run(asyncio.sleep(0.1))
            assert httpx.get(srv.url + "/health", timeout=30).status_code == 503
    finally:
        llm.shutdown()


def test_serve_cli_dp2_with_tp2(tiny_models, tmp_path) -> None:  # noqa: ANN001
    """``pagedllm serve --data-parallel-size 2 --tensor-parallel-size 2``: two engine cores,
    each with two gloo ranks, behind one server; its greedy completion is one engine's."""
    from tests.server.test_engine_process import ROOT, _free_port

    path = tiny_models("llama")
    port = _free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", path, "--port", str(port),
           "--dtype", "float32", "--device", "cpu", "--max-model-len", "512", "--seed", "0",
           "--num-gpu-blocks-override", "160", "--data-parallel-size", "2",
           "--tensor-parallel-size", "2", "--uvicorn-log-level", "warning"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        got = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert "2 engine core processes ready" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert [got["choices"][0]["text"]] == _one_engine(path, [[5, 6, 7, 8]], 12)


def _worker_pids(core: Any) -> list[int]:
    return core.executor.pids


def test_dead_tp_worker_is_reported_on_health(tiny_models) -> None:  # noqa: ANN001
    """An engine core with two tensor-parallel workers: rank 1 killed -> the next request
    fails with a 503 naming the dead worker, /health turns 503 (bounded time: no hang)."""
    args = dataclasses.replace(_args(tiny_models("llama"), 1), tensor_parallel_size=2)
    llm = MPAsyncLLM.from_engine_args(args)
    try:
        with serve(llm) as srv:
            assert _complete(srv, [1, 2, 3, 4])["choices"][0]["text"]
            pids = srv.in_core(_worker_pids)
            os.kill(pids[1], signal.SIGKILL)
            r = srv.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8})
            # the engine cannot run without the rank: 503, saying which worker died
            assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"], r.text
            deadline = time.monotonic() + 60
            while httpx.get(srv.url + "/health", timeout=30).status_code != 503:
                assert time.monotonic() < deadline, "/health still 200"
                time.sleep(0.2)
    finally:
        llm.shutdown()
