"""A live ``pagedllm serve`` on loopback (the default model, loaded once per session), clients.

The server runs as a subprocess started through the real CLI, so the tests exercise exactly
what users run; it requires an API key, so every test also exercises the auth path. For
in-process tests of ``build_app``: ``tiny_async_llm`` (an engine thread on a tiny model) and
``asgi_call`` (one request through the ASGI transport).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pagedllm.utils.child import stop_process, wait_healthy
from pagedllm.utils.net import free_port as _free_port

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def tiny_async_llm(model: str) -> Iterator[Any]:
    """An ``AsyncLLM`` (engine thread) on ``model``: float32, CPU, 128 tokens, 32 blocks."""
    from pagedllm.config import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM

    args = EngineArgs(model=model, dtype="float32", max_model_len=128,
                      num_gpu_blocks_override=32, device="cpu")  # fmt: skip
    engine = AsyncLLM.from_engine_args(args)
    try:
        yield engine
    finally:
        engine.shutdown()


def asgi_call(app: Any, method: str, path: str, **kw: Any) -> Any:
    """One request to an in-process app (no server, no lifespan); the ``httpx.Response``."""
    import asyncio

    async def go() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


API_KEY = "test-key-123"
MAX_MODEL_LEN = 512
MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LiveServer:
    """Where the test server listens, and how to reach it."""

    url: str
    api_key: str
    model: str
    max_model_len: int
    log_path: Path
    pid: int = 0  # the server process (a test that kills it)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, **kwargs: object) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key)
        return openai.OpenAI(base_url=f"{self.url}/v1", **kwargs)

    def async_client(self, **kwargs: object) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", self.api_key)
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", **kwargs)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {series (name plus labels, as printed): value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the series of ``name`` whose labels include ``labels``."""
        total = 0.0
        for key, value in self.metrics().items():
            m = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", key)
            if m is None or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                total += value
        return total

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until no request runs or waits and every KV block is free (AssertionError else)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            running = _pick(m, "vllm:num_requests_running")
            waiting = _pick(m, "vllm:num_requests_waiting")
            usage = _pick(m, "vllm:kv_cache_usage_perc")
            free = _pick(m, "pagedllm:kv_cache_free_blocks")
            total = _pick(m, "pagedllm:kv_cache_total_blocks")
            if running == 0 and waiting == 0 and usage == 0 and free == total > 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"server not idle: running={running} waiting={waiting} "
                    f"kv_usage={usage} free={free}/{total}"
                )
            time.sleep(0.2)


def _pick(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))


@contextlib.contextmanager
def live_server(log_path: Path, extra_args: tuple[str, ...] = ()) -> Iterator[LiveServer]:
    """``pagedllm serve`` on the packaged SmolLM2-135M-Instruct GGUF, with an API key and
    ``extra_args``; skips when the model is not installed."""
    try:
        from pagedllm.model.packaged import smollm2_gguf_path

        smollm2_gguf_path()
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"default model not installed: {e}")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PAGEDLLM_API_KEY", None)
    cmd = [
        sys.executable, "-m", "pagedllm.entrypoints.cli", "serve",
        "--port", str(port), "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
        "--seed", "0", "--uvicorn-log-level", "warning", *extra_args,
    ]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_healthy(proc, url, 300):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}):\n{log_path.read_text()}")
            raise RuntimeError(f"server did not start:\n{log_path.read_text()}")
        yield LiveServer(url, API_KEY, MODEL_NAME, MAX_MODEL_LEN, log_path, proc.pid)
    finally:
        stop_process(proc, 20)
        log.close()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """``pagedllm serve`` on the packaged SmolLM2-135M-Instruct GGUF, with an API key and
    tool calling (hermes-format calls found under tool_choice "auto")."""
    tools = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with live_server(tmp_path_factory.mktemp("server") / "server.log", tools) as srv:
        yield srv


@pytest.fixture(scope="session")
def client(server: LiveServer) -> openai.OpenAI:
    """The official OpenAI client pointed at the test server (no retries: errors surface)."""
    return server.client(max_retries=0, timeout=120)
