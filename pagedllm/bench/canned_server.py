"""A canned OpenAI-compatible server with no model: the ceiling of a load generator.

``POST /v1/completions`` and ``/v1/chat/completions`` answer ``max_tokens`` (default 16) canned
words, streamed (``"stream": true``) as server-sent events in the same chunk shapes as
``pagedllm serve`` (chat opens with a role chunk; one chunk per token, the last with
``finish_reason "length"``; then the usage chunk when ``stream_options.include_usage`` is set,
and ``data: [DONE]``), or as one JSON response. ``GET /v1/models`` lists ``--model``;
``GET /health`` is 200. Prompt tokens are counted as whitespace-separated words (or token ids).

It runs on plain asyncio with hand-written HTTP/1.1 (keep-alive, chunked transfer encoding).
One "engine" loop emits the next chunk of every open stream per tick, each chunk its own write
and its own HTTP chunk, as a real server does once per decode step, then yields to the event
loop (``--step-ms`` waits between ticks; 0 is as fast as it can). A stream whose socket buffer
holds more than ``--max-buffer`` bytes (a client that reads slower than it is sent) skips ticks
until it drains. ``--processes N`` serves from N processes on one port (``SO_REUSEPORT``);
``--loop``: asyncio or uvloop (``auto``: uvloop where installed).

    pagedllm bench canned_server --port 8000 --processes 2
    python -m pagedllm.bench.canned_server --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pagedllm.bench._http_client import run
from pagedllm.utils.net import free_port

WORDS = (" the", " of", " and", " to", " in", " is", " was", " for")
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The server's flags."""
    p.add_argument("--host", default="127.0.0.1", metavar="ADDRESS", help="Bind address.")
    p.add_argument("--port", type=int, default=8000, metavar="PORT", help="TCP port.")
    p.add_argument("--model", default="canned", metavar="NAME", help="The model name it reports.")
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        metavar="N",
        help="Server processes on one port (SO_REUSEPORT).",
    )
    p.add_argument(
        "--reuse-port",
        action="store_true",
        help="Bind with SO_REUSEPORT (implied by --processes above 1).",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="Wait between token ticks (0: none, as fast as it can).",
    )
    p.add_argument(
        "--max-buffer",
        type=int,
        default=1 << 16,
        metavar="BYTES",
        help="Bytes unsent per stream before the stream skips ticks until it drains.",
    )
    p.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="Event loop (auto: uvloop where installed).",
    )


def _frame(payload: bytes) -> bytes:
    """One HTTP chunk carrying one server-sent event."""
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


class _Stream:
    """One streamed response: its frames, sent one per tick."""

    __slots__ = ("transport", "frames", "next", "done")

    def __init__(self, transport: asyncio.WriteTransport, frames: list[bytes],
                 done: asyncio.Future[None]) -> None:  # fmt: skip
        self.transport = transport
        self.frames = frames
        self.next = 0
        self.done = done


class _Engine:
    """Writes the next frame of every open stream once per tick."""

    def __init__(self, step_s: float, max_buffer: int) -> None:
        self.step_s = step_s
        self.max_buffer = max_buffer
        self.active: list[_Stream] = []
        self.joined: list[_Stream] = []
        self.wake = asyncio.Event()

    def add(self, s: _Stream) -> None:
        self.joined.append(s)
        self.wake.set()

    async def run(self) -> None:
        while True:
            if not self.active and not self.joined:
                self.wake.clear()
                await self.wake.wait()
            if self.joined:
                self.active += self.joined
                self.joined = []
            still, wrote = [], False
            for s in self.active:
                t = s.transport
                if t.is_closing():
                    if not s.done.done():
                        s.done.set_result(None)
                    continue
                if t.get_write_buffer_size() > self.max_buffer:
                    still.append(s)
                    continue
                t.write(s.frames[s.next])
                wrote = True
                s.next += 1
                if s.next == len(s.frames):
                    if not s.done.done():
                        s.done.set_result(None)
                else:
                    still.append(s)
            self.active = still
            # every client slower than we send: wait for it instead of spinning on the CPU
            await asyncio.sleep(self.step_s if wrote else max(self.step_s, 1e-3))


class CannedServer:
    """The request handler (one per process)."""

    def __init__(self, model: str, step_s: float = 0.0, max_buffer: int = 1 << 16) -> None:
        self.model = model
        self.engine = _Engine(step_s, max_buffer)
        self.created = int(time.time())
        self.served = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve requests on one keep-alive connection until the client closes it."""
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, *_ = lines[0].split(" ") + ["", ""]
                headers = {}
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length") or 0))
                await self.respond(writer, method, path.split("?", 1)[0], body)
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def respond(self, writer: asyncio.StreamWriter, method: str, path: str,
                      body: bytes) -> None:  # fmt: skip
        if path in ("/health", "/v1/health") and method == "GET":
            return self.send(writer, 200, b"")
        if path == "/v1/models" and method == "GET":
            card = {"id": self.model, "object": "model", "created": self.created,
                    "owned_by": "pagedllm-canned"}  # fmt: skip
            return self.send(writer, 200, _dumps({"object": "list", "data": [card]}))
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return self.send(writer, 404, _dumps({"error": {"message": f"no route {path}"}}))
        if method != "POST":
            return self.send(writer, 405, b"")
        try:
            req = json.loads(body)
            chat = path == "/v1/chat/completions"
            prompt = (
                " ".join(str(m.get("content") or "") for m in req["messages"])
                if chat
                else req["prompt"]
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return self.send(writer, 400, _dumps({"error": {"message": f"bad request: {e}"}}))
        self.served += 1
        n_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        n_out = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-canned{os.getpid()}-{self.served}"
        model = req.get("model") or self.model
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                 "total_tokens": n_prompt + n_out}  # fmt: skip
        if not req.get("stream"):
            text = "".join(WORDS[i % len(WORDS)] for i in range(n_out))
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length",
                                      "stop_reason": None}  # fmt: skip
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return self.send(writer, 200, _dumps({
                "id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": self.created, "model": model, "choices": [choice], "usage": usage,
            }))  # fmt: skip
        include_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        frames = self.frames(chat, rid, model, n_out, usage if include_usage else None)
        writer.write(_STREAM_HEAD)
        done = asyncio.get_running_loop().create_future()
        self.engine.add(_Stream(writer.transport, frames, done))  # type: ignore[arg-type]
        await done

    def frames(self, chat: bool, rid: str, model: str, n_out: int,
               usage: dict[str, Any] | None) -> list[bytes]:  # fmt: skip
        """The stream's HTTP chunks, one per tick: (chat: the role chunk), one per token, then
        the usage chunk, ``[DONE]`` and the body's end together."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": self.created, "model": model}

        def chunk(word: str | None, fr: str | None, delta: dict[str, Any] | None = None) -> bytes:
            c: dict[str, Any] = {"index": 0}
            if chat:
                c["delta"] = delta if delta is not None else {"content": word}
            else:
                c["text"] = word
            c |= {"logprobs": None, "finish_reason": fr, "stop_reason": None}
            d = head | {"choices": [c]}
            if usage is not None:
                d["usage"] = None
            return _frame(_dumps(d))

        words = [chunk(w, None) for w in WORDS]
        frames = [chunk(None, None, {"role": "assistant", "content": ""})] if chat else []
        frames += [words[i % len(words)] for i in range(n_out - 1)]
        if n_out > 0:
            frames.append(chunk(WORDS[(n_out - 1) % len(WORDS)], "length"))
        tail = b""
        if usage is not None:
            tail += _frame(_dumps(head | {"choices": [], "usage": usage}))
        frames.append(tail + _frame(b"[DONE]") + b"0\r\n\r\n")
        return frames

    @staticmethod
    def send(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
        ctype = b"application/json" if body else b"text/plain"
        writer.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status, _REASONS.get(status, "").encode(), ctype, len(body), body)
        )


async def serve(host: str, port: int, model: str = "canned", reuse_port: bool = False,
                step_ms: float = 0.0, max_buffer: int = 1 << 16) -> None:  # fmt: skip
    """Serve until cancelled; prints one ready line to stdout once it listens."""
    srv = CannedServer(model, step_ms / 1e3, max_buffer)
    server = await asyncio.start_server(srv.handle, host, port, reuse_port=reuse_port or None,
                                        backlog=4096, limit=1 << 20)  # fmt: skip
    engine = asyncio.ensure_future(srv.engine.run())
    loop = "uvloop" if "uvloop" in type(asyncio.get_running_loop()).__module__ else "asyncio"
    print(f"canned server {os.getpid()} ready on http://{host}:{port}/v1 ({loop})", flush=True)
    try:
        async with server:
            await server.serve_forever()
    finally:
        engine.cancel()


def _serve_process(host: str, port: int, model: str, step_ms: float, max_buffer: int,
                   loop: str) -> None:  # fmt: skip
    try:
        run(serve(host, port, model, True, step_ms, max_buffer), loop)
    except KeyboardInterrupt:
        pass


def main(args: argparse.Namespace) -> int:
    """Serve until interrupted (SIGINT or SIGTERM), from ``--processes`` processes."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    reuse = args.reuse_port or args.processes > 1
    ctx = multiprocessing.get_context("spawn")
    extra = [ctx.Process(target=_serve_process, daemon=True,
                         args=(args.host, args.port, args.model, args.step_ms, args.max_buffer,
                               args.loop))
             for _ in range(args.processes - 1)]  # fmt: skip
    for p in extra:
        p.start()
    try:
        run(
            serve(args.host, args.port, args.model, reuse, args.step_ms, args.max_buffer), args.loop
        )
    except KeyboardInterrupt:
        pass
    finally:
        for p in extra:
            p.terminate()
        for p in extra:
            p.join(5)
    return 0


@contextmanager
def spawned(processes: int = 1, model: str = "canned", step_ms: float = 0.0,
            timeout: float = 60.0, loop: str = "auto") -> Iterator[str]:  # fmt: skip
    """``processes`` canned servers on one free loopback port (``SO_REUSEPORT``), each its own
    subprocess; yields the ``/v1`` URL once every one listens, and stops them all after."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.bench.canned_server", "--port", str(port),
           "--model", model, "--step-ms", str(step_ms), "--loop", loop]  # fmt: skip
    if processes > 1:
        cmd.append("--reuse-port")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(processes):
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE))
        deadline = time.monotonic() + timeout
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()  # the ready line, or EOF if it died
            if b"ready" not in line or time.monotonic() > deadline:
                raise RuntimeError(f"canned server did not start (exit {p.poll()})")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m pagedllm.bench.canned_server")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
