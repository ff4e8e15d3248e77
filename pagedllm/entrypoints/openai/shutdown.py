"""Graceful shutdown of the HTTP server: drain, then a deadline, then final events.

    SIGTERM ─► draining: /health answers 503 (a load balancer stops sending work), new
    │          generation requests get 503, requests in flight run on; the listener stays
    │          open so probes still get their answer
    ├─► every request done ───────────────► exit (status 0)
    ├─► --shutdown-timeout passes ────────► every open request ends: a stream gets a final
    │                                       error event and ``[DONE]``, a plain request 503;
    │                                       then exit
    └─► a second SIGTERM, or SIGINT ──────► the same ending at once

uvicorn alone stops listening at the first SIGTERM and then waits for every stream with no
deadline (an orchestrator's grace period then ends in a kill mid-stream, with no final event);
a second SIGTERM does nothing. ``DrainingServer`` replaces its signal handling.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm.engine.async_llm import AsyncLLMBase, EngineError, RequestStream
from pagedllm.entrypoints.openai.errors import RequestError, error_response

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # uvicorn's and Kubernetes' usual grace period
FLUSH_GRACE_S = 2.0  # after the final events, how long connections get to send them
# routes that keep answering while draining (probes, scrapes); every other route counts as work
PROBE_PATHS = frozenset({"/health", "/metrics", "/version", "/v1/models", "/ping"})
# the dashboard's pages and streams: watching, not work (its streams end when draining starts)
WATCH_PREFIX = "/dashboard"


def shutdown_timeout_of(args: Any) -> float:
    """``--shutdown-timeout`` of ``pagedllm serve``'s arguments (the default without one)."""
    timeout = getattr(args, "shutdown_timeout", None)
    return DEFAULT_SHUTDOWN_TIMEOUT_S if timeout is None else float(timeout)


def exit_cleanly(signum: int, frame: FrameType | None) -> None:
    """SIGTERM handler for after uvicorn has stopped (it raises the signal again): exit through
    the callers' cleanup with status 0."""
    raise SystemExit(0)


class ServerShuttingDown(EngineError):
    """A request ended because the server is shutting down (HTTP 503)."""

    status_code = 503


class Drain:
    """The server's drain state: requests in flight, the open engine request streams, and
    the ending of them all at the deadline.

    Event-loop side only, except ``begin``/``end_now`` which are safe from a signal handler
    (they schedule their work on the loop)."""

    def __init__(self, llm: AsyncLLMBase) -> None:
        self.llm = llm
        self.draining = False
        self.in_flight = 0  # HTTP requests of non-probe routes being served
        self.streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ended = False
        self._task: asyncio.Task[None] | None = None

    def track(self, stream: RequestStream) -> None:
        """Remember an engine request so the deadline can end it."""
        self.streams.add(stream)

    def begin(self, timeout_s: float, on_done: Callable[[], None]) -> None:
        """Start draining (idempotent): ``on_done`` runs once every request has ended, by
        itself or at the deadline ``timeout_s`` seconds from now."""
        if self.draining or self.loop is None:
            return
        self.draining = True
        deadline = time.monotonic() + timeout_s
        logger.info("draining: %d request(s) in flight, deadline %.0f s", self.in_flight,
                    timeout_s)  # fmt: skip

        def start() -> None:
            self._task = asyncio.ensure_future(self._watch(deadline, on_done))

        self.loop.call_soon_threadsafe(start)

    async def _watch(self, deadline: float, on_done: Callable[[], None]) -> None:
        while self.in_flight > 0 and time.monotonic() < deadline and not self._ended:
            await asyncio.sleep(0.05)
        if self.in_flight > 0 and not self._ended:
            logger.warning("shutdown timeout: ending %d request(s) in flight", self.in_flight)
            self.end_all()
        on_done()

    def end_now(self) -> None:
        """End every open request now (a second signal); safe from a signal handler."""
        self.draining = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.end_all)

    def end_all(self) -> None:
        """Every open engine request ends: its consumer raises ``ServerShuttingDown`` after
        the outputs already queued (a stream sends them, then an error event and [DONE]), and
        the engine aborts it (its blocks are freed)."""
        self._ended = True
        err = ServerShuttingDown("the server is shutting down; this request was cut short.")
        ids = []
        for stream in list(self.streams):
            if not stream.finished:
                stream.put(err)
                ids.append(stream.request_id)
        if ids:
            self.llm.abort_nowait(ids)


class DrainMiddleware:
    """Counts requests in flight; while draining, refuses new work with 503 (an OpenAI error
    body) and lets probes through."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in PROBE_PATHS or path.startswith(WATCH_PREFIX):
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            err = RequestError("the server is shutting down.", None, 503, "ServiceUnavailable")
            await error_response(err)(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the shutdown described in the module docstring.

    ``on_signal`` callbacks run (in the signal handler) on each handled signal, e.g. to pass
    it on to other API server processes."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self.on_signal: list[Callable[[int], None]] = []
        self._signals = 0

    async def startup(self, sockets: Any = None) -> None:
        self.drain.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._captured_signals.append(sig)
        self._signals += 1
        for fn in self.on_signal:
            fn(sig)
        if sig == signal.SIGTERM and self._signals == 1 and self.drain.loop is not None:
            self.drain.begin(self.timeout_s, self.stop)
            return
        logger.info("signal %d: ending every request now", sig)
        self.drain.end_now()
        self.stop()

    def stop(self) -> None:
        """Stop listening and exit once connections have sent their last bytes (at most
        ``FLUSH_GRACE_S``; a stream's last event is queued by now)."""
        self.config.timeout_graceful_shutdown = FLUSH_GRACE_S
        self.should_exit = True
