"""Graceful shutdown of ``pagedllm serve`` (``entrypoints/openai/shutdown.py``): SIGTERM drains
the requests in flight while /health answers 503 and new work is refused, the drain deadline
(``--shutdown-timeout``) or a second signal ends the rest with a final error event in every
stream, and the process exits with status 0 (engine core gone too)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.shutdown_drain import open_streams, stream_ending
from tests.server.test_engine_process import _Server, _wait_gone

pytest.importorskip("fastapi")


def _body(max_tokens: int) -> dict:
    return {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}  # fmt: skip


def _ending(lines: list[str]) -> tuple[str | None, dict | None]:
    """(finish_reason of the last token chunk, the error event) of one finished stream."""
    end = stream_ending(lines)
    assert end["done"], lines[-3:]  # [DONE] last, no cut connection
    return end["finish_reason"], end["error"]


def _run(server: _Server, max_tokens: int, while_draining) -> tuple[list[list[str]], float]:  # noqa: ANN001
    """Open the streams, SIGTERM the server once they all run, call ``while_draining()``;
    (the streams' lines, seconds from SIGTERM to exit)."""

    async def main() -> tuple[list[list[str]], float]:
        started = asyncio.Event()
        task = asyncio.create_task(open_streams(server.url, _body(max_tokens), started))
        await asyncio.wait_for(started.wait(), 60)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(while_draining)
        lines = await asyncio.wait_for(task, 120)
        await asyncio.to_thread(server.proc.wait, 60)
        return lines, time.monotonic() - t0

    return asyncio.run(main())


def test_sigterm_drains_in_flight_streams(tiny_models, tmp_path: Path) -> None:  # noqa: ANN001
    """Within the deadline every stream runs to its end (no error); meanwhile /health is 503,
    a new request gets 503 with an OpenAI body, and the process exits 0."""
    server = _Server(tiny_models("llama"), tmp_path / "s.log", "--shutdown-timeout", "120")
    probes: dict[str, httpx.Response] = {}

    def while_draining() -> None:
        time.sleep(0.2)  # the signal is handled
        probes["health"] = httpx.get(f"{server.url}/health", timeout=30)
        body = {"prompt": [5], "max_tokens": 2}
        probes["new"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)

    try:
        # 500 tokens (of the 512 the server allows): the drain must outlast the probes, which
        # under a loaded CI host found a 200-token drain over and the server gone
        lines, _ = _run(server, 500, while_draining)
        assert probes["health"].status_code == 503
        assert probes["new"].status_code == 503
        assert probes["new"].json()["error"]["code"] == 503
        for stream in lines:
            reason, error = _ending(stream)
            assert error is None and reason == "length", stream[-3:]
        assert server.proc.returncode == 0
        assert _wait_gone(server.core_pid, 30)
    finally:
        server.stop()


@pytest.mark.parametrize("second_signal", [None, signal.SIGTERM, signal.SIGINT])
def test_deadline_or_second_signal_ends_every_stream(
    tiny_models,  # noqa: ANN001
    tmp_path: Path,
    second_signal: int | None,
) -> None:
    """Streams that cannot finish in time: at the deadline (0.3 s), or at once on a second
    SIGTERM or a SIGINT, every one gets a final 503 error event and [DONE]; exit status 0."""
    timeout = "0.3" if second_signal is None else "300"
    server = _Server(tiny_models("llama"), tmp_path / "s.log", "--shutdown-timeout", timeout,
                     "--num-gpu-blocks-override", "600")  # fmt: skip

    def while_draining() -> None:
        if second_signal is not None:
            time.sleep(0.1)
            server.proc.send_signal(second_signal)

    try:
        lines, _ = _run(server, 500, while_draining)
        for stream in lines:
            reason, error = _ending(stream)
            assert reason is None and error is not None, stream[-3:]
            assert error["code"] == 503 and "shutting down" in error["message"]
        assert server.proc.returncode == 0
        assert _wait_gone(server.core_pid, 30)
    finally:
        server.stop()
