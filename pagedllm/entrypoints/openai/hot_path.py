"""The two endpoints that carry the load, served with fewer layers per request and per chunk.

Every layer between the socket and the endpoint costs front-end CPU per request, and every
send wrapper costs it per chunk; with the front end busy, a new request's first token waits
for all of it. FastAPI's route path (exception, exit-stack, body-limit and telemetry layers,
the router, the endpoint wrapper) and Starlette's ``StreamingResponse`` (an anyio task group
per response, a send wrapper per layer) do nothing these two endpoints need.

``HotRoutes`` is a pure ASGI middleware added innermost (inside the drain and API key
middlewares, which still apply): ``POST /v1/completions`` and ``/v1/chat/completions`` go
straight to their endpoint functions, with the same error handling as the app's exception
handlers; every other request goes on to FastAPI. The routes stay registered in FastAPI too
(the OpenAPI schema, ``/docs``).

``SSEResponse`` writes a stream's events with one ``send`` each, and watches for the client's
disconnect with one plain task; a disconnect cancels the stream (its requests are aborted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.entrypoints.openai.errors import RequestError, error_response
from pagedllm.entrypoints.openai.serving import SSE_DONE, SSEStream

Endpoint = Callable[[Request], Awaitable[Response]]


class HotRoutes:
    """Serves ``POST`` on ``routes``' paths without FastAPI's per-request layers.

    ``on_error(request, exc)`` answers an exception other than ``RequestError`` (the app's
    catch-all handler: logged, 500 or 503)."""

    def __init__(
        self,
        app: ASGIApp,
        routes: dict[str, Endpoint],
        on_error: Callable[[Request, Exception], Awaitable[Response]],
    ) -> None:
        self.app = app
        self.routes = routes
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = None
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.routes.get(scope["path"])
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await endpoint(request)
        except RequestError as e:
            response = error_response(e)
        except Exception as e:  # noqa: BLE001 - answered like the app's catch-all handler
            response = await self.on_error(request, e)
        await response(scope, receive, send)


class SSEResponse(StreamingResponse):
    """Streams an ``SSEStream`` (``text/event-stream``); however the response ends (done, client
    gone, send error), the requests behind it are aborted (a no-op for the finished ones)."""

    def __init__(self, stream: SSEStream) -> None:
        super().__init__(stream.events, media_type="text/event-stream")
        self.stream = stream
        self._gone = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        watch = asyncio.get_running_loop().create_task(self._watch(receive, task))
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            more = True
            async for text in self.body_iterator:
                more = not text.endswith(SSE_DONE)  # [DONE] is last: it ends the body too
                body = text.encode() if isinstance(text, str) else text
                await send({"type": "http.response.body", "body": body, "more_body": more})
            if more:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not self._gone:
                raise
            # our own cancel (the client left): the response just ends (3.10 counts none)
            if hasattr(task, "uncancel"):
                task.uncancel()
        except OSError:  # the client left while a chunk was being written
            pass
        finally:
            watch.cancel()
            self.stream.abort()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:  # its ``finally`` (abort, bookkeeping) runs now
                await aclose()

    async def _watch(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        """Wait for ``http.disconnect``; then cancel the streaming task. (A ``receive`` that
        fails ends the watch only: the stream's own send then finds the connection gone.)"""
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - nothing to watch any more
            return
        self._gone = True
        task.cancel()
