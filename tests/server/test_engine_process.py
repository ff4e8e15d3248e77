"""The engine core process's lifetime: it dies with the server, the server with it, and its
death is a clear error for every request in flight (never a hang)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedllm.engine.async_llm import EngineDeadError
from pagedllm.engine.mp_async_llm import MPAsyncLLM
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils.child import process_alive
from pagedllm.utils.net import free_port as _free_port

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

ROOT = Path(__file__).resolve().parents[2]
LONG = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_killed_core_fails_streams_and_reports(tiny_models) -> None:  # noqa: ANN001
    from pagedllm.config import EngineArgs

    args = EngineArgs(model=tiny_models("llama"), dtype="float32", device="cpu",
                      max_model_len=512, num_gpu_blocks_override=256)  # fmt: skip
    llm = MPAsyncLLM.from_engine_args(args)
    reports: list[str] = []
    llm.on_dead.append(reports.append)
    try:

        async def run() -> None:
            stream = await llm.add_request({"prompt_token_ids": [5, 6, 7]}, LONG)
            await stream.__anext__()  # it runs
            os.kill(llm.core.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exit code -9"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineDeadError):
                await llm.add_request("another", LONG)

        asyncio.run(asyncio.wait_for(run(), 60))
        assert not llm.is_running
        assert len(reports) == 1 and f"pid {llm.core.pid}" in reports[0]
    finally:
        llm.shutdown()


class _Server:
    """``pagedllm serve`` on a tiny model, and the pid of its engine core (from its log)."""

    def __init__(self, model: str, log: Path, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model,
               "--port", str(self.port), "--dtype", "float32", "--device", "cpu",
               "--max-model-len", "512", "--num-gpu-blocks-override", "256",
               "--uvicorn-log-level", "warning", *extra]  # fmt: skip
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"server exited:\n{log.read_text()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"server did not start:\n{log.read_text()}"
            time.sleep(0.3)
        m = re.search(r"engine core process (\d+) ready", log.read_text())
        assert m, log.read_text()
        self.core_pid = int(m.group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if process_alive(self.core_pid):
            os.kill(self.core_pid, signal.SIGKILL)
        self._log.close()


def test_server_exits_when_its_core_dies(tiny_models, tmp_path: Path) -> None:  # noqa: ANN001
    """A streaming request in flight ends with an error event, /health fails, the server
    process exits with status 1 and says why."""
    server = _Server(tiny_models("llama"), tmp_path / "server.log")
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")  # it runs
            os.kill(server.core_pid, signal.SIGKILL)
            rest = "\n".join(lines)
        assert '"error"' in rest and "engine core process" in rest, rest[-500:]
        assert server.proc.wait(timeout=30) == 1
        assert "exited (exit code -9)" in server.log_path.read_text()
    finally:
        server.stop()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_no_core_outlives_its_server(tiny_models, tmp_path: Path, sig: int) -> None:  # noqa: ANN001
    """Killed (no chance to clean up) or terminated, the server leaves no engine core."""
    server = _Server(tiny_models("llama"), tmp_path / "server.log")
    try:
        assert process_alive(server.core_pid)
        server.proc.send_signal(sig)
        server.proc.wait(timeout=30)
        assert _wait_gone(server.core_pid, 30), "the engine core outlived its server"
    finally:
        server.stop()


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def test_several_api_servers_share_one_core(tiny_models, tmp_path: Path) -> None:  # noqa: ANN001
    """--api-server-count 2: two HTTP processes on one port in front of one engine core;
    concurrent requests from separate connections each get their own outputs (the core
    routes a request's tokens to the process that sent it), and SIGTERM ends them all."""
    server = _Server(tiny_models("llama"), tmp_path / "server.log", "--api-server-count", "2")
    try:
        kids = _children(server.proc.pid)
        assert server.core_pid in kids and len(kids) == 2  # the core and API server 1
        prompts = [[5 + i, 6, 7 + 2 * i] for i in range(12)]

        def body(p: list[int], stream: bool) -> dict:
            return {"prompt": p, "max_tokens": 6, "temperature": 0, "stream": stream}

        url = f"{server.url}/v1/completions"
        expected = [httpx.post(url, json=body(p, False), timeout=60).json() for p in prompts]

        async def run() -> list[str]:
            async def one(p: list[int]) -> str:  # a connection of its own each
                async with httpx.AsyncClient(timeout=60) as c:
                    r = await c.post(url, json=body(p, True))
                    chunks = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: {")]
                    return "".join(json.loads(x)["choices"][0]["text"] for x in chunks)

            return await asyncio.gather(*(one(p) for p in prompts * 2))

        got = asyncio.run(run())
        assert got == [e["choices"][0]["text"] for e in expected] * 2
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
        assert all(_wait_gone(pid, 30) for pid in kids)
    finally:
        server.stop()


def test_a_port_in_use_fails_before_the_engine_starts(tiny_models, tmp_path: Path) -> None:  # noqa: ANN001
    """``pagedllm serve`` binds its port before it loads anything: a port already in use ends
    it at once, with no engine core started (and no child of the engine can take the port
    while the model loads)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", tiny_models("llama"),
               "--port", str(port), "--device", "cpu", "--dtype", "float32"]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    log = done.stdout + done.stderr
    assert "Address already in use" in log or "address already in use" in log, log[-2000:]
    assert "engine core process" not in log  # it failed before starting one
