"""A minimal HTTP/1.1 client on asyncio for the serving benchmark (``--client raw``).

It does only what ``pagedllm bench serving`` needs, with as little work per streamed byte as
possible: keep-alive connections to one host (a pool that grows to the number of requests in
flight), ``POST`` of a JSON body, the status line and headers, then the body de-chunked
(``Transfer-Encoding: chunked``, what uvicorn sends when streaming), by ``Content-Length``, or up
to the connection's end.

It sits on asyncio's transport/protocol layer (the layer under ``asyncio.open_connection``'s
streams): the body is parsed inside ``data_received`` and handed to a plain callback, one call per
read from the socket, so a streamed response wakes its request's task only when it ends, not once
per read as a ``StreamReader`` would. On a loaded client, where one read is often one SSE event,
that wake-up is a large part of the cost per event.

Not supported (not needed by the benchmark): proxies, redirects, compression, pipelining, 1xx
other than skipping them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar
from urllib.parse import urlsplit

_MAX_HEAD = 1 << 16
T = TypeVar("T")


def loop_name(loop: str = "auto") -> str:
    """The event loop ``loop`` names: ``auto`` is uvloop where it is installed, else asyncio."""
    if loop == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    if loop not in ("asyncio", "uvloop"):
        raise ValueError(f"unknown event loop {loop!r}")
    return loop


def run(coro: Coroutine[Any, Any, T], loop: str = "auto") -> T:
    """``asyncio.run(coro)`` on the event loop ``loop`` names (see ``loop_name``)."""
    if loop_name(loop) == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


# what _Conn expects next in the stream
_HEAD, _SIZE, _DATA, _DATA_END, _TRAILER, _LENGTH, _TO_EOF, _IDLE = range(8)


class HTTPError(Exception):
    """A response that is not valid HTTP/1.1, or a connection lost in mid-response."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection, parsing the response to the request in flight as it arrives.

    ``start(on_data)`` arms it for one response; ``done`` then resolves to (status, body, keep):
    with ``on_data`` and status 200 the body goes to ``on_data`` piece by piece (one call per
    read) and ``body`` is empty; else ``body`` is the whole body. ``keep``: reusable after it.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.state = _IDLE
        self.rest = b""  # bytes received but not parsed yet
        self.got_bytes = False
        self.done: asyncio.Future[tuple[int, bytes, bool]] | None = None
        self.on_data: Callable[[bytes], None] | None = None
        self.sink: Callable[[bytes], None] = lambda b: None
        self.parts: list[bytes] = []
        self.status = 0
        self.keep = True
        self.left = 0

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.state == _IDLE:  # nothing asked: never reuse a connection out of step
            self.keep = False
            return
        self.got_bytes = True
        try:
            if self.state == _HEAD:
                data, self.rest = self.rest + data if self.rest else data, b""
                data = self._head(data)
                if self.state == _HEAD or not data:
                    return
                if self.state == _IDLE:  # bytes after a complete response: out of step
                    self.keep = False
                    return
            if self.state == _LENGTH:
                self._length(data)
            elif self.state == _TO_EOF:
                self.sink(data)
            else:
                self._chunked(self.rest + data if self.rest else data)
        except Exception as e:  # noqa: BLE001 - a bad response or a failing callback
            self._fail(e)
            if self.transport is not None:
                self.transport.close()

    def eof_received(self) -> bool:
        if self.state == _TO_EOF:
            self._finish(keep=False)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.state == _TO_EOF:
            self._finish(keep=False)
        elif self.state != _IDLE:
            self._fail(HTTPError(f"connection closed in mid-response ({exc or 'EOF'})"))

    # one response

    def start(self, on_data: Callable[[bytes], None] | None) -> asyncio.Future[Any]:
        self.state, self.rest, self.got_bytes = _HEAD, b"", False
        self.on_data, self.parts = on_data, []
        self.done = asyncio.get_running_loop().create_future()
        return self.done

    def _finish(self, keep: bool) -> None:
        self.state = _IDLE
        self.keep = self.keep and keep and not self.rest and not self.closed
        done, self.done = self.done, None
        if done is not None and not done.done():
            body = b"".join(self.parts)
            self.parts = []
            done.set_result((self.status, body, self.keep))

    def _fail(self, e: BaseException) -> None:
        self.state = _IDLE
        self.keep = False
        done, self.done = self.done, None
        if done is not None and not done.done():
            done.set_exception(e)

    def _head(self, data: bytes) -> bytes:
        """Parse the status line and headers; returns the bytes after them."""
        while True:
            i = data.find(b"\r\n\r\n")
            if i < 0:
                if len(data) > _MAX_HEAD:
                    raise HTTPError("response head too long")
                self.rest = data
                return b""
            lines = data[:i].decode("latin-1").split("\r\n")
            data = data[i + 4 :]
            parts = lines[0].split(None, 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
                raise HTTPError(f"bad status line: {lines[0][:100]!r}")
            status = int(parts[1])
            if not 100 <= status < 200:
                break
        headers: dict[str, str] = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        conn = headers.get("connection", "").lower()
        self.status = status
        self.keep = conn != "close" and (parts[0] != "HTTP/1.0" or conn == "keep-alive")
        self.sink = self.on_data if status == 200 and self.on_data else self.parts.append
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.state, self.left = _SIZE, 0
        elif "content-length" in headers:
            self.state, self.left = _LENGTH, int(headers["content-length"])
            if not self.left:
                self._finish(keep=True)
        else:
            self.state = _TO_EOF
        return data

    def _length(self, data: bytes) -> None:
        if len(data) >= self.left:
            data, self.rest = data[: self.left], data[self.left :]
            self.sink(data)
            self._finish(keep=True)
            return
        self.left -= len(data)
        self.sink(data)

    def _chunked(self, data: bytes) -> None:
        """De-chunk what arrived: all of its chunk data goes to the sink in one call."""
        pos, n, parts = 0, len(data), []
        state, left = self.state, self.left
        while pos < n:
            if state == _SIZE:  # the common case first: a whole chunk in this read
                j = data.find(b"\r\n", pos)
                if j < 0:
                    break
                try:
                    left = int(data[pos:j], 16)
                except ValueError:
                    left = _chunk_size(data[pos:j])
                pos = j + 2
                if not left:
                    state = _TRAILER
                    continue
                end = pos + left
                if end + 2 <= n and data.startswith(b"\r\n", end):
                    parts.append(data[pos:end])
                    pos = end + 2
                else:
                    state = _DATA
            elif state == _DATA:
                take = min(left, n - pos)
                parts.append(data[pos : pos + take])
                pos += take
                left -= take
                if left == 0:
                    state = _DATA_END
            elif state == _DATA_END:
                if n - pos < 2:
                    break
                if not data.startswith(b"\r\n", pos):
                    raise HTTPError("chunk data not followed by CRLF")
                pos += 2
                state = _SIZE
            else:  # _TRAILER: header lines, then an empty line ends the body
                j = data.find(b"\r\n", pos)
                if j < 0:
                    break
                if j > pos:
                    pos = j + 2
                    continue
                if parts:
                    self.sink(parts[0] if len(parts) == 1 else b"".join(parts))
                self.rest = data[j + 2 :]
                self._finish(keep=True)
                return
        self.rest = data[pos:]
        self.state, self.left = state, left
        if parts:
            self.sink(parts[0] if len(parts) == 1 else b"".join(parts))


def _chunk_size(line: bytes) -> int:
    """The size on a chunk-size line that has extensions (``1a;name=value``)."""
    try:
        return int(line.split(b";", 1)[0], 16)
    except ValueError:
        raise HTTPError(f"bad chunk size line {line[:40]!r}") from None


class RawClient:
    """Keep-alive HTTP/1.1 requests to the host of ``base_url`` (paths are joined to its path).

    ``await client.post_stream(path, body, on_data)`` sends ``body`` (bytes, JSON) and calls
    ``on_data(bytes)`` with each piece of the response body as it arrives; it returns the status
    and, when the status is not 200, the whole body instead (``on_data`` is then not called).
    """

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if u.scheme == "https" else None
        )
        self.prefix = u.path.rstrip("/").encode()
        lines = [f"Host: {u.netloc}", "User-Agent: pagedllm-bench", "Accept: */*"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self._head = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self._idle: list[_Conn] = []

    async def __aenter__(self) -> RawClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, []
        for c in idle:
            if c.transport is not None:
                c.transport.close()

    async def _open(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Conn, self.host, self.port, ssl=self.ssl)
        return conn

    async def _acquire(self) -> tuple[_Conn, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and conn.keep:
                return conn, True
        return await self._open(), False

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        on_data: Callable[[bytes], None] | None = None,
    ) -> tuple[int, bytes]:
        """Send one request; returns (status, body). With ``on_data`` and status 200 the body is
        handed to ``on_data`` piece by piece as it arrives and the returned body is empty."""
        req = b"%s %s%s HTTP/1.1\r\n" % (method.encode(), self.prefix, path.encode()) + self._head
        if body is not None:
            req += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        req += b"\r\n" + (body or b"")
        conn, reused = await self._acquire()
        while True:
            done = conn.start(on_data)
            assert conn.transport is not None
            conn.transport.write(req)
            try:
                status, data, keep = await done
                break
            except HTTPError:
                # a kept-alive connection the server closed while idle: once more on a new one
                if not (reused and conn.closed and not conn.got_bytes):
                    raise
                conn, reused = await self._open(), False
            except BaseException:
                if conn.transport is not None:
                    conn.transport.close()
                raise
        if keep:
            self._idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()
        return status, data

    async def post_stream(
        self, path: str, body: bytes, on_data: Callable[[bytes], None]
    ) -> tuple[int, bytes]:
        """``POST`` a JSON body and stream the response body into ``on_data``."""
        return await self.request("POST", path, body, on_data)

    async def get_json(self, path: str) -> Any:
        """``GET`` a JSON document (HTTPError unless the status is 200)."""
        status, data = await self.request("GET", path)
        if status != 200:
            raise HTTPError(f"GET {path}: HTTP {status}: {data[:300]!r}")
        return json.loads(data)
