"""The dashboard's routes on the OpenAI server (``pagedllm serve``; ``--no-dashboard`` leaves
them out):

    GET /dashboard                the page (static files in this package: no build step, no
                                  fetch from the network)
    GET /dashboard/static/NAME    its script and style sheet
    GET /dashboard/state          the state as JSON, for scripts (``docs/DASHBOARD.md``)
    GET /dashboard/events?hz=H    the same, pushed as server-sent events, at most 4 a second

    POST /dashboard/login         {"api_key": KEY}: sets the cookie the page's requests carry

With an API key (``--api-key``) the state and the events need it (``APIKeyMiddleware``): a
bearer header from a script, or the HTTP-only cookie that the page's key form gets from
``/dashboard/login`` (the key never goes in a URL, which access logs keep). The page and its
files hold no data and need no key.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from pagedllm.dashboard import KEY_COOKIE, STATIC
from pagedllm.dashboard.service import DashboardService, to_json
from pagedllm.entrypoints.openai.errors import RequestError, error_response

_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}


def add_dashboard(app: FastAPI, service: DashboardService, api_key: str | None) -> None:
    """Register the dashboard's routes on ``app``, served from ``service`` (whose sampler
    the app's lifespan starts and stops)."""
    files = {p.name: p for p in STATIC.iterdir() if p.suffix in _TYPES}

    @app.get("/dashboard", include_in_schema=False)
    async def page() -> Response:
        response = FileResponse(files["index.html"], media_type="text/html")
        response.headers["Cache-Control"] = "no-store"
        return response

    @app.post("/dashboard/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        try:
            key = (await request.json()).get("api_key")
        except Exception:  # not a JSON object: no key
            key = None
        if not api_key:  # no key needed: nothing to remember
            return Response(status_code=204)
        if not isinstance(key, str) or not secrets.compare_digest(key.encode(), api_key.encode()):
            err = RequestError("Unauthorized: wrong API key.", "api_key", 401,
                               "AuthenticationError")  # fmt: skip
            return error_response(err)
        response = Response(status_code=204)
        response.set_cookie(KEY_COOKIE, key, httponly=True, samesite="strict",
                            path="/dashboard")  # fmt: skip
        return response

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        path = files.get(name)
        if path is None:
            return error_response(RequestError(f"no file {name!r}", None, 404, "NotFoundError"))
        return FileResponse(path, media_type=_TYPES[path.suffix])

    @app.get("/dashboard/state", summary="The dashboard's state (engine snapshot + history)")
    async def state(since: float | None = None) -> Response:
        """The engine snapshot (block map, requests, per-head KVs, host tiers, stats) and the
        last ten minutes of one-second samples (after ``since``, a Unix time, if given)."""
        snap = await service.snapshot()
        return Response(to_json(service.state(snap, since)), media_type="application/json")

    @app.get("/dashboard/events", include_in_schema=False)
    async def events(request: Request, hz: float | None = None) -> Response:
        async def stream() -> Any:
            gen = service.events(hz)
            try:
                async for chunk in gen:
                    if await request.is_disconnected():
                        break
                    yield chunk
            finally:
                await gen.aclose()

        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)
