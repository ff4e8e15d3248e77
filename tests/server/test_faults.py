"""Fault injection over HTTP (issue 18): a failing engine step, a tokenizer error, a
detokenizer error, a client that never reads its stream. Each failure ends its own requests
with an OpenAI error (a status, or an error event in the stream); the server serves the next
ones with the same greedy text; no KV block leaks. Both front ends: the engine on a thread of
the server (``--no-engine-process``) and the engine core in its own process (the default).

The server is ``build_app`` under uvicorn on a thread of this process (a real socket), so the
tests can patch the front end (tokenizer, detokenizer); faults inside the engine core go in
through ``call_in_engine`` / ``call_in_core`` (a function run between two steps, in the core
process for the default mode). Engine-level cases: tests/engine/test_faults.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import socket
import threading
import time
from argparse import Namespace
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest

from pagedllm.engine.async_llm import (
    MAX_UNREAD_OUTPUTS,
    AsyncLLM,
    AsyncLLMBase,
    RequestStream,
    put_all,
)
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.mp_async_llm import MPAsyncLLM
from pagedllm.entrypoints.openai.server import build_app
from pagedllm.outputs import CompletionOutput, RequestOutput

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

API_KEY = "fault-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TIMEOUT = 60.0  # generous: a hang fails the test instead of CI
POISON = "POISON"  # a prompt holding this is the one that fails
SEND_BUFFER_BYTES = 4096  # the server's sockets' (see ``serve``)


@dataclass
class Live:
    """A server on a real port: its URL, engine, app and event loop."""

    url: str
    llm: AsyncLLMBase
    app: Any
    loop: asyncio.AbstractEventLoop

    def on_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run a coroutine on the server's event loop (the engine's front end lives there)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT)

    def in_core(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine_core)`` between two steps, in the core process for ``MPAsyncLLM``
        (``fn`` must then pickle: a module-level function or a partial of one)."""
        llm = self.llm
        if isinstance(llm, MPAsyncLLM):
            return self.on_loop(llm.call_in_core(fn))
        assert isinstance(llm, AsyncLLM)
        return self.on_loop(llm.call_in_engine(lambda engine: fn(engine.engine_core)))

    def post(self, route: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.url + route, json=body, headers=HEADERS, timeout=TIMEOUT)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0,
                             timeout=TIMEOUT)  # fmt: skip

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0,
                                  timeout=TIMEOUT)  # fmt: skip

    def wait_idle(self) -> None:
        """Until the engine holds no request and every KV block is free (invariants
        checked); AssertionError after TIMEOUT."""
        deadline = time.monotonic() + TIMEOUT
        while True:
            busy, free, total = self.in_core(core_state)
            if not busy and free == total:
                return
            assert time.monotonic() < deadline, f"not idle: busy={busy} free={free}/{total}"
            time.sleep(0.05)


def core_state(core: Any) -> tuple[bool, int, int]:
    """(requests unfinished, free blocks, blocks); KV invariants checked when idle."""
    kv = core.scheduler.kv_cache_manager
    busy = core.has_unfinished_requests()
    if not busy:
        core.check_integrity()
    return busy, kv.num_free_blocks(), kv.num_blocks


def fail_steps(core: Any, times: int = 1, after: int = 0) -> None:
    """After ``after`` more steps that run the model, the next ``times`` such steps raise
    RuntimeError("injected fault") (in the runner, after scheduling: their requests are in
    the failed step)."""
    runner = core.model_runner
    launch = runner.launch_forward
    passes, left = [after], [times]

    def flaky(scheduler_output: Any) -> Any:
        if passes[0] > 0:
            passes[0] -= 1
            return launch(scheduler_output)
        left[0] -= 1
        if left[0] == 0:
            del runner.launch_forward  # back to the class method
        raise RuntimeError("injected fault")

    runner.launch_forward = flaky


def num_steps(core: Any) -> int:
    return core.num_steps


@contextlib.contextmanager
def serve(llm: AsyncLLMBase) -> Iterator[Live]:
    """``build_app(llm)`` under uvicorn on a thread, until the block ends."""
    app = build_app(llm, Namespace(api_key=API_KEY, served_model_name="tiny"))
    listen = socket.socket()
    # connections inherit a small send buffer (loopback's default may hold megabytes): a
    # client that does not read holds the server's writes back after ~80 KB, as on a network
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    listen.bind(("127.0.0.1", 0))
    port = listen.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=5)
    server = uvicorn.Server(config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve([listen]),),
                              name="uvicorn-test", daemon=True)  # fmt: skip
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield Live(f"http://127.0.0.1:{port}", llm, app, loop)
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)
        if thread.is_alive():  # a connection that never closes
            server.force_exit = True
            thread.join(TIMEOUT)
        llm.shutdown()
        loop.close()
        listen.close()


def _engine(mode: str, tiny_models: Callable[[str], str]) -> AsyncLLMBase:
    from pagedllm.config import EngineArgs

    args = EngineArgs(model=tiny_models("llama"), dtype="float32", device="cpu", seed=0,
                      max_model_len=512, num_gpu_blocks_override=160)  # fmt: skip
    if mode == "thread":
        return AsyncLLM.from_engine_args(args)
    # the core's OpenMP threads sleep between parallel regions: spinning, they took the cores
    # this process's server and clients need on a loaded 2-core host (steps ~5x slower)
    with mock.patch.dict(os.environ, {"OMP_WAIT_POLICY": "PASSIVE"}):
        return MPAsyncLLM.from_engine_args(args)


@pytest.fixture(scope="module", params=["thread", "process"])
def live(request, tiny_models) -> Iterator[Live]:  # noqa: ANN001
    with serve(_engine(request.param, tiny_models)) as srv:
        yield srv


def _body(prompt: str, max_tokens: int = 12, **kw: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **kw}  # fmt: skip


def _oa(prompt: str, max_tokens: int = 12) -> dict[str, Any]:
    """``_body`` as the openai client's arguments."""
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "extra_body": {"ignore_eos": True}}  # fmt: skip


def _text(live: Live, prompt: str) -> str:
    r = live.post("/v1/completions", _body(prompt))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _check_error(r: httpx.Response, status: int, needle: str) -> None:
    """``r`` is ``status`` with OpenAI's error body, whose message holds ``needle``."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert needle in err["message"], err


def _events(lines: Iterator[str]) -> list[Any]:
    """The JSON of a stream's events, then the string "[DONE]"."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _stream_text(events: list[Any]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and
                   e.get("choices"))  # fmt: skip


# ----------------------------------------------------------------------- a failing step


def test_failed_step_fails_its_requests_and_the_server_serves_on(live: Live) -> None:
    """A stream running when a step raises ends with an error event (500) and [DONE]; a
    plain request in a failed step is a 500 with OpenAI's body (the openai client raises
    InternalServerError); then the same prompt gets the same greedy text as before the
    faults, /health is 200 and no block leaked."""
    before = _text(live, "The quick brown fox")
    body = _body("a long one", max_tokens=400, stream=True)
    # the fault is armed before the stream starts, for its 9th step: armed after the first
    # event, a fast engine on a loaded host had finished all 400 tokens by then (CI saw it)
    live.in_core(functools.partial(fail_steps, after=8))
    with httpx.stream("POST", live.url + "/v1/completions", json=body, headers=HEADERS,
                      timeout=TIMEOUT) as r:  # fmt: skip
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")  # it runs
        events = _events(lines)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 500 and "injected fault" in error["message"], events[-2]
    assert len(_stream_text(events)) < 400  # cut short

    live.in_core(fail_steps)
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        live.client().completions.create(**_oa("another one"))

    assert _text(live, "The quick brown fox") == before
    assert httpx.get(live.url + "/health", timeout=TIMEOUT).status_code == 200
    live.wait_idle()


# ------------------------------------------------------------------------ tokenizer


def test_tokenizer_error_fails_only_its_request(live: Live, monkeypatch) -> None:  # noqa: ANN001
    """The tokenizer raises on one prompt among five sent together: that one is a 500 with
    OpenAI's body, the other four get their greedy text; a chat template that raises on one
    conversation makes that one a 400 naming ``messages``; the server serves on."""
    prompts = [f"prompt number {i}" for i in range(4)]
    expected = [_text(live, p) for p in prompts]
    tok = live.llm.tokenizer
    encode, template = tok.encode, tok.apply_chat_template

    def bad_encode(text: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(text, str) and POISON in text:
            raise RuntimeError("injected tokenizer fault")
        return encode(text, *args, **kw)

    def bad_template(conversation: Any, *args: Any, **kw: Any) -> Any:
        if POISON in json.dumps(conversation):
            import jinja2

            raise jinja2.TemplateError("injected template fault")
        return template(conversation, *args, **kw)

    monkeypatch.setattr(tok, "encode", bad_encode)
    monkeypatch.setattr(tok, "apply_chat_template", bad_template)

    async def together() -> list[Any]:
        client = live.async_client()
        calls = [client.completions.create(**_oa(p)) for p in prompts]
        calls.insert(2, client.completions.create(**_oa(f"a {POISON} prompt")))
        chats = [
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": c}], max_tokens=4
            )
            for c in ("hello", f"{POISON}!", "hi there")
        ]
        return await asyncio.gather(*calls, *chats, return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(together(), TIMEOUT))
    bad, chat_bad = results.pop(2), results.pop(5)
    assert isinstance(bad, openai.InternalServerError), bad
    assert bad.status_code == 500 and "injected tokenizer fault" in bad.body["message"]
    assert [r.choices[0].text for r in results[:4]] == expected
    assert isinstance(chat_bad, openai.BadRequestError), chat_bad
    assert chat_bad.body["param"] == "messages" and "injected template" in chat_bad.message
    assert all(r.choices[0].finish_reason == "length" for r in results[4:])
    r = live.post("/tokenize", {"prompt": POISON})  # the tokenizer thread survives too
    _check_error(r, 500, "injected tokenizer fault")
    assert live.post("/tokenize", {"prompt": "fine"}).status_code == 200
    assert _text(live, prompts[0]) == expected[0]
    live.wait_idle()


# ---------------------------------------------------------------------- detokenizer


def test_detokenizer_error_fails_only_its_request(live: Live, monkeypatch) -> None:  # noqa: ANN001
    """The incremental detokenizer of the requests whose prompt ends with POISON raises at
    their third step: such a stream ends with an error event (500) after its first tokens, a
    plain request is a 500; the requests beside them get their greedy text; the failed
    requests are aborted in the engine (it stops stepping them: far fewer steps than their
    400 tokens) and free their blocks."""
    prompts = [f"neighbour {i}" for i in range(3)]
    expected = [_text(live, p) for p in prompts]
    marker = live.llm.tokenizer.encode(POISON, add_special_tokens=False)
    real_init = IncrementalDetokenizer.__init__

    def init(self: IncrementalDetokenizer, tokenizer: Any, prompt_token_ids: list[int],
             **kw: Any) -> None:  # fmt: skip
        real_init(self, tokenizer, prompt_token_ids, **kw)
        if list(prompt_token_ids[-len(marker) :]) == marker:
            real_update, calls = self.update, [0]

            def update(token_ids: list[int], **kw: Any) -> str | None:
                calls[0] += 1
                if calls[0] == 3:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault")
                return real_update(token_ids, **kw)

            self.update = update  # type: ignore[method-assign]

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", init)
    steps_before = live.in_core(num_steps)

    async def together() -> tuple[list[Any], list[Any], httpx.Response]:
        async with httpx.AsyncClient(base_url=live.url, headers=HEADERS, timeout=TIMEOUT) as c:

            async def stream(prompt: str, max_tokens: int) -> list[Any]:
                body = _body(prompt, max_tokens, stream=True)
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    return _events([line async for line in r.aiter_lines()])

            plain = c.post("/v1/completions", json=_body(f"plain {POISON}", 400))
            calls = [stream(f"stream {POISON}", 400), *(stream(p, 12) for p in prompts), plain]
            *streams, response = await asyncio.gather(*calls)
            return streams[0], streams[1:], response

    poisoned, good, plain = asyncio.run(asyncio.wait_for(together(), TIMEOUT))
    assert poisoned[-1] == "[DONE]" and poisoned[-2]["error"]["code"] == 500
    assert "making this request's output failed" in poisoned[-2]["error"]["message"]
    assert "injected fault" in poisoned[-2]["error"]["message"]
    chunks = [e for e in poisoned if isinstance(e, dict) and e.get("choices")]
    assert 1 <= len(chunks) < 400  # its first tokens came
    _check_error(plain, 500, "injected fault")
    assert [_stream_text(events) for events in good] == expected
    live.wait_idle()
    assert live.in_core(num_steps) - steps_before < 100  # not 400: they were aborted


# ---------------------------------------------------------------------- slow reader


def test_a_client_that_never_reads_blocks_no_one(live: Live) -> None:
    """A client opens a fat stream (300 tokens with 20 logprobs each, ~150 KB of events, more
    than the sockets and uvicorn buffer) on a socket with a 4 KiB receive buffer and never
    reads: another client's 5
    requests complete meanwhile with their greedy text; the unread request runs to its end in
    the engine and frees its blocks; its stream holds at most MAX_UNREAD_OUTPUTS outputs
    while the socket stays unread; closing the socket ends it."""
    expected = _text(live, "another client")
    body = _body("never read", 300, stream=True, logprobs=20)
    payload = json.dumps(body).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", int(live.url.rsplit(":", 1)[1])))
    try:
        slow.sendall(request)
        with live.client() as client:
            for _ in range(5):
                out = client.completions.create(**_oa("another client"))
                assert out.choices[0].text == expected
        live.wait_idle()  # the unread request ended in the engine, blocks free
        unread = [s for s in live.app.state.drain.streams if not s.finished]
        assert len(unread) == 1, unread  # the SSE writer waits on the socket, not the engine
        assert 1 <= unread[0].num_unread <= MAX_UNREAD_OUTPUTS
        assert live.llm.stats()["num_streams"] == 0
    finally:
        slow.close()
    deadline = time.monotonic() + TIMEOUT
    while any(not s.finished for s in live.app.state.drain.streams):
        assert time.monotonic() < deadline, "the closed stream was never cleaned up"
        time.sleep(0.05)
    assert _text(live, "another client") == expected


def test_unread_outputs_merge_into_one() -> None:
    """A stream nobody reads keeps at most MAX_UNREAD_OUTPUTS outputs, however many steps
    come; reading then yields the same text and tokens as every delta in order, and an error
    put last is raised after them."""

    class Owner:
        def abort_nowait(self, request_id: str) -> None:
            pass

    def delta(i: int, fin: bool = False) -> RequestOutput:
        c = CompletionOutput(0, f"t{i} ", [i], None, None, "length" if fin else None)
        return RequestOutput("r", "p", [1], None, [c], fin)

    async def run() -> None:
        stream = RequestStream("r", Owner(), asyncio.get_running_loop())  # type: ignore[arg-type]
        for i in range(1000):
            stream.put(delta(i))
            assert stream.num_unread <= MAX_UNREAD_OUTPUTS
        stream.put(RuntimeError("late"))
        stream.put(delta(1000, fin=True))  # after the error: never read
        out = await stream.__anext__()
        assert out.outputs[0].token_ids == list(range(1000)) and not out.finished
        assert out.outputs[0].text == "".join(f"t{i} " for i in range(1000))
        with pytest.raises(RuntimeError, match="late"):
            await stream.__anext__()

    asyncio.run(run())


def test_first_outputs_are_handed_out_first() -> None:
    """One step's outputs for running streams and for a request's first token: the new
    request's consumer wakes first (its first chunk is written before the others' next ones),
    each stream still gets its own outputs in order."""

    class Owner:
        def abort_nowait(self, request_id: str) -> None:
            pass

    def delta(rid: str, i: int) -> RequestOutput:
        return RequestOutput(rid, "p", [1], None, [CompletionOutput(0, f"t{i}", [i], None, None,
                                                                    None)], False)  # fmt: skip

    async def run() -> list[tuple[str, int]]:
        loop = asyncio.get_running_loop()
        a, b, c = (RequestStream(r, Owner(), loop) for r in "abc")  # type: ignore[arg-type]
        put_all([(a, delta("a", 0)), (c, delta("c", 0))])  # a and c are running
        assert [(await s.__anext__()).request_id for s in (a, c)] == ["a", "c"]
        woke: list[tuple[str, int]] = []

        async def consume(s: RequestStream) -> None:
            out = await s.__anext__()
            woke.append((out.request_id, out.outputs[0].token_ids[0]))

        tasks = [asyncio.create_task(consume(s)) for s in (a, b, c)]
        await asyncio.sleep(0)  # every consumer waits
        put_all([(a, delta("a", 1)), (b, delta("b", 0)), (c, delta("c", 1))])
        await asyncio.gather(*tasks)
        return woke

    assert asyncio.run(run()) == [("b", 0), ("a", 1), ("c", 1)]


# ------------------------------------------------------------- failures in a row: dead


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_failed_steps_in_a_row_kill_the_engine(mode: str, tiny_models) -> None:  # noqa: ANN001
    """Every step fails: the first two requests are 500s, the third (the third failed step in
    a row) a 503 saying the engine is dead; /health answers 503 and so does every request
    after; with the engine process, the core exits with status 1."""
    with serve(_engine(mode, tiny_models)) as live:
        live.in_core(functools.partial(fail_steps, times=100))
        for _ in range(2):
            _check_error(live.post("/v1/completions", _body("doomed")), 500, "injected fault")
        r = live.post("/v1/completions", _body("doomed"))
        _check_error(r, 503, "3 steps failed in a row")
        assert httpx.get(live.url + "/health", timeout=TIMEOUT).status_code == 503
        _check_error(live.post("/v1/completions", _body("after")), 503, "3 steps failed")
        if isinstance(live.llm, MPAsyncLLM):
            assert live.llm.core.wait_exit(TIMEOUT) == 1
