"""``pagedllm proxy``: one OpenAI-compatible endpoint in front of prefill and decode engines
(prefill/decode disaggregation, ``core/kv_transfer/``).

    pagedllm proxy --prefill http://localhost:8100 --decode http://localhost:8200 --port 8000

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes to a prefill engine first
(``kv_role`` ``kv_producer``), as the same body with one output token, no streaming and
``kv_transfer_params: {"do_remote_decode": true}``; its response names the transfer of the
prompt's KV. Then the original body, with that ``kv_transfer_params``, goes to a decode engine
(``kv_consumer``), whose answer (streamed or not) is the client's: every output token comes
from the decode engine, which reads the prompt's KV instead of computing it. Several prefill
or decode URLs are taken in turn (round robin).

Failures stay with their request: a prefill engine's error answer is passed back as it is
(a bad request is the client's 400), an engine that does not answer gives 502 with an OpenAI
error body naming it, and the other engine goes on serving. A streaming client that goes away
closes the proxy's connection to the decode engine, which aborts the request.

The HTTP client is the standard library's (one blocking call per request on a worker thread),
so the proxy needs only the server's packages.
"""

import argparse
import asyncio
import itertools
import json
import logging
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")


class UpstreamError(Exception):
    """An engine did not answer (refused, reset, timed out)."""


def _post(url: str, body: dict, timeout: float, auth: str | None) -> Any:
    """POST ``body`` as JSON (with the client's Authorization header); the open response
    (2xx) or an HTTPError (its status and body)."""
    headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, OSError) as e:
        raise UpstreamError(f"{url} did not answer: {getattr(e, 'reason', e)}") from None


def prefill_body(path: str, body: dict) -> dict:
    """The prefill engine's request: one token, not streamed, its KV handed over."""
    drop = ("stream_options", "best_of", "min_tokens", "max_tokens", "max_completion_tokens")
    out = {k: v for k, v in body.items() if k not in drop}
    out.update(stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    out["max_completion_tokens" if path.endswith("chat/completions") else "max_tokens"] = 1
    return out


class Proxy:
    """Round-robin prefill and decode URLs and the two calls of each request."""

    def __init__(self, prefill: list[str], decode: list[str], timeout: float = 600.0) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode URL.")
        self.prefill = itertools.cycle([u.rstrip("/") for u in prefill])
        self.decode = itertools.cycle([u.rstrip("/") for u in decode])
        self.decode_urls = [u.rstrip("/") for u in decode]
        self.timeout = timeout

    def run_prefill(self, path: str, body: dict, auth: str | None) -> tuple[int, dict]:
        """(status, JSON body) of the prefill call."""
        url = next(self.prefill) + path
        try:
            with _post(url, prefill_body(path, body), self.timeout, auth) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, _json_or_error(e.read(), e.code)

    def open_decode(self, path: str, body: dict, params: dict | None, auth: str | None) -> Any:
        """The decode call's open response (HTTPError for an error status)."""
        body = dict(body)
        if params is not None:
            body["kv_transfer_params"] = params
        return _post(next(self.decode) + path, body, self.timeout, auth)


def _json_or_error(raw: bytes, status: int) -> dict:
    try:
        return json.loads(raw)
    except ValueError:
        return error_body(raw.decode(errors="replace")[:300], status, "UpstreamError")


def error_body(message: str, status: int, kind: str) -> dict:
    """OpenAI's error body (the server's ``ErrorResponse`` shape)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def build_app(proxy: Proxy) -> Any:
    """The proxy's FastAPI app."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="pagedllm proxy")

    async def forward(path: str, request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(error_body("the body is not JSON.", 400, "BadRequestError"), 400)
        if not isinstance(body, dict):
            return JSONResponse(
                error_body("the body must be an object.", 400, "BadRequestError"), 400
            )
        try:
            auth = request.headers.get("authorization")
            status, first = await asyncio.to_thread(proxy.run_prefill, path, body, auth)
            if status != 200:
                return JSONResponse(first, status)
            params = first.get("kv_transfer_params")
            if params is None:
                logger.warning("the prefill engine named no KV transfer: is it a kv_producer?")
            resp = await asyncio.to_thread(proxy.open_decode, path, body, params, auth)
        except UpstreamError as e:
            return JSONResponse(error_body(str(e), 502, "BadGateway"), 502)
        except urllib.error.HTTPError as e:
            return JSONResponse(_json_or_error(e.read(), e.code), e.code)
        if not body.get("stream"):
            with resp:
                data = await asyncio.to_thread(resp.read)
            return JSONResponse(_json_or_error(data, resp.status), resp.status)

        async def lines() -> AsyncIterator[bytes]:
            # a client that goes away cancels this generator: the decode engine's response
            # is closed, and that engine, seeing its client gone, aborts the request
            try:
                while line := await asyncio.to_thread(resp.readline):
                    yield line
            finally:
                resp.close()

        return StreamingResponse(lines(), media_type="text/event-stream")

    for route in ROUTES:

        async def handler(request: Request, _path: str = route) -> Any:
            return await forward(_path, request)

        app.post(route)(handler)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        url = proxy.decode_urls[0] + "/v1/models"
        auth = request.headers.get("authorization")
        req = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
        try:
            with await asyncio.to_thread(urllib.request.urlopen, req, None, 30) as r:
                return JSONResponse(json.loads(r.read()))
        except urllib.error.HTTPError as e:
            return JSONResponse(_json_or_error(e.read(), e.code), e.code)
        except (urllib.error.URLError, OSError) as e:
            return JSONResponse(error_body(f"{url} did not answer: {e}", 502, "BadGateway"), 502)

    @app.get("/health")
    async def health() -> Any:
        return JSONResponse({})

    return app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="Base URLs of the prefill engines (kv_role kv_producer).")  # fmt: skip
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="Base URLs of the decode engines (kv_role kv_consumer).")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="Seconds to wait for an engine's answer.")  # fmt: skip


def run_proxy(ns: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(Proxy(ns.prefill, ns.decode, ns.timeout))
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    return 0
