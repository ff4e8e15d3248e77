"""The Ray executor (issue 20): a local Ray cluster of two nodes on 127.0.0.1 (``ray start
--head`` and ``ray start --address``, one CPU each, started by the test), tensor parallelism 2
across them: each rank on its own node, the greedy tokens of one rank; a rank's actor killed
mid-run fails the engine with an error naming it, in bounded time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.utils.net import free_port

ray = pytest.importorskip("ray")

RAY = str(Path(sys.executable).with_name("ray"))
ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _ray(*args: str) -> None:
    env = {**os.environ, **ENV}
    done = subprocess.run([RAY, *args], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode:  # (ray's own words: a CI failure of `ray start` must say why)
        raise RuntimeError(f"ray {' '.join(args)} exited {done.returncode}:\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")  # fmt: skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """The address of a two-node Ray cluster on this host."""
    if not shutil.which(RAY):
        pytest.skip("the ray command is not installed")
    port = free_port()
    while 10002 <= port <= 19999:  # Ray's default worker ports: it refuses a GCS port there
        port = free_port()
    address = f"127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in (*ENV, "RAY_ADDRESS")}
    try:
        _ray("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
             "--num-cpus", "1", "--include-dashboard=false", "--disable-usage-stats")  # fmt: skip
        _ray("start", "--address", address, "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
             "--disable-usage-stats")  # fmt: skip
        os.environ.update({**ENV, "RAY_ADDRESS": address})
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _engine(path: str, tp: int, backend: str) -> LLM:
    return LLM(path, dtype="float32", device="cpu", max_model_len=256,
               kv_cache_memory_bytes=32 << 20, tensor_parallel_size=tp,
               distributed_executor_backend=backend)  # fmt: skip


def _prompts() -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(3, 500, 20).tolist()} for _ in range(4)]


def test_tp2_across_two_nodes(cluster: str, tiny_models) -> None:  # noqa: ANN001
    path = tiny_models("qwen3")
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _engine(path, 1, "uni").generate(_prompts(), sp)]
    llm = _engine(path, 2, "ray")
    try:
        executor = llm.llm_engine.engine_core.executor
        assert len(set(executor.nodes)) == 2  # one rank on each node
        got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), sp, use_tqdm=False)]
        assert got == want
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_killed_actor_is_a_clear_error(cluster: str, tiny_models) -> None:  # noqa: ANN001
    llm = _engine(tiny_models("llama"), 2, "ray")
    executor = llm.llm_engine.engine_core.executor
    execute = executor.execute_model
    calls = [0]

    def execute_then_kill(so):  # noqa: ANN001, ANN202
        calls[0] += 1
        if calls[0] == 3:
            ray.kill(executor._actors[1])
        return execute(so)

    executor.execute_model = execute_then_kill
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    t = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="worker rank 1 .*died"):
            llm.generate(_prompts(), sp, use_tqdm=False)
        assert time.monotonic() - t < 60
    finally:
        llm.llm_engine.engine_core.shutdown()
