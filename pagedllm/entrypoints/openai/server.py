"""The OpenAI-compatible HTTP server: ``build_app(async_llm, args)`` and ``run_server(args)``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (and
``GET``/``DELETE /v1/responses/{id}``, see ``responses.py``), ``GET /v1/models`` (the base
model and its LoRA adapters; ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
where the environment allows, see ``models.py``),
``GET /health``, ``GET /version``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``.
With an API key (``--api-key`` or ``PAGEDLLM_API_KEY``) every ``/v1`` route needs
``Authorization: Bearer <key>`` (401 otherwise); the others stay open, as in vLLM.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for malformed
JSON, missing fields, wrong types, out-of-range values and prompts longer than the context, 401
for a missing or wrong key, 404 for an unknown model or route, 413 for a body over
``--max-request-body-bytes``, 500 if the engine fails on a request (it keeps serving the other
requests), 503 once the engine is dead and while the server shuts down. A client that
disconnects aborts its request, streaming or not. SIGTERM drains (``shutdown.py``): in-flight
requests run on up to ``--shutdown-timeout`` seconds, then end with a final error event; a
second signal ends them at once.

Engine features reachable over HTTP (body fields; vLLM's extras go in the JSON body, e.g. the
``openai`` client's ``extra_body``):

- ``n`` sequences per prompt (parallel sampling on shared KV blocks), streamed as chunks that
  each carry one choice with its ``index``; ``best_of`` (completions, non-streaming) returns
  the n best of best_of by cumulative logprob. n, best_of and the beam width may not exceed
  ``--max-num-seqs`` (400): a request's sequences run in one batch.
- ``use_beam_search`` with ``n`` (the beam width; completions: ``best_of`` if given),
  ``length_penalty``, ``early_stopping`` (true, false or "never"); non-streaming only, and
  fields beam search cannot honour (logprobs, stop, penalties, temperature > 0, structured
  outputs, cache_salt) are a 400 naming the field.
- Structured outputs: ``response_format`` (``json_object``, ``json_schema``), ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``, or ``structured_outputs``
  (see ``structured.py``). The grammar is compiled before the request is queued, off the event
  loop and the engine thread: one that does not compile is a 400 with the compiler's message.
  The grammar manager (xgrammar's tokenizer info) is created on a helper thread at start-up.
- ``priority`` (int, default 0): lower is served first under ``--scheduling-policy
  priority``; ignored by the other policies and by beam search.
- ``cache_salt`` (string): the request's prompt blocks are hashed with this salt, so it shares
  prefix-cache entries only with requests giving the same salt (tenant isolation).
  ``usage.prompt_tokens_details.cached_tokens`` reports every response's prefix-cache hit.

Importing this module loads FastAPI but not torch; the model loads in ``run_server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import secrets
import signal
import socket
import threading
from collections.abc import AsyncIterator, Awaitable
from http.cookies import SimpleCookie
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedllm import __version__
from pagedllm.config import engine_args_from
from pagedllm.dashboard import KEY_COOKIE
from pagedllm.engine.async_llm import AsyncLLM, AsyncLLMBase, EngineDeadError, EngineError
from pagedllm.entrypoints.openai.chat import ServingChat, load_chat_template
from pagedllm.entrypoints.openai.completions import ServingCompletion
from pagedllm.entrypoints.openai.errors import RequestError, error_response
from pagedllm.entrypoints.openai.hot_path import Endpoint, HotRoutes, SSEResponse
from pagedllm.entrypoints.openai.models import ServingModels, runtime_updates_allowed
from pagedllm.entrypoints.openai.openapi import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
    VersionResponse,
    install_request_bodies,
    responses,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoRAAdapterRequest,
    TokenizeRequest,
    now,
)
from pagedllm.entrypoints.openai.responses import ResponsesRequest, ServingResponses
from pagedllm.entrypoints.openai.serving import internal_error, off_loop
from pagedllm.entrypoints.openai.shutdown import (
    Drain,
    DrainingServer,
    DrainMiddleware,
    exit_cleanly,
    shutdown_timeout_of,
)
from pagedllm.entrypoints.openai.tools import ToolMode
from pagedllm.metrics import CONTENT_TYPE_LATEST, ServerMetrics

logger = logging.getLogger(__name__)


class APIKeyMiddleware:
    """Pure ASGI middleware (no buffering of streamed bodies): ``/v1`` and the dashboard's
    data (``/dashboard/state``, ``/dashboard/events``) need the bearer key; a browser on the
    dashboard gives it once to ``POST /dashboard/login``, which sets an HTTP-only cookie the
    data routes accept instead (``dashboard/routes.py``; a key in a URL would end up in
    access logs). The page and its static files need no key: they hold no data."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()
        self.expected = f"Bearer {api_key}".encode()

    def _cookie_key(self, scope: Scope) -> bool:
        cookie = next((v for k, v in scope["headers"] if k == b"cookie"), b"")
        if not cookie:
            return False
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(cookie.decode("latin-1"))
        except Exception:  # a malformed cookie header: no key from it
            return False
        given = jar[KEY_COOKIE].value.encode() if KEY_COOKIE in jar else b""
        return bool(given) and secrets.compare_digest(given, self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        dashboard = path in ("/dashboard/state", "/dashboard/events")
        if (path.startswith("/v1") or dashboard) and scope.get("method") != "OPTIONS":
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            ok = secrets.compare_digest(auth, self.expected)
            if not ok and dashboard:
                ok = self._cookie_key(scope)
            if not ok:
                err = RequestError(
                    "Unauthorized: a valid 'Authorization: Bearer <api key>' header is required.",
                    status_code=401,
                    err_type="AuthenticationError",
                )
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


DEFAULT_MAX_BODY_BYTES = 8 << 20


async def read_body(request: Request) -> bytes:
    """The request body, at most ``app.state.max_request_body_bytes`` (413 beyond it, from the
    Content-Length header when there is one, else as soon as the stream passes the limit)."""
    limit = getattr(request.app.state, "max_request_body_bytes", DEFAULT_MAX_BODY_BYTES)

    def too_large() -> RequestError:
        return RequestError(
            f"The request body is larger than this server accepts ({limit} bytes; "
            "--max-request-body-bytes).",
            status_code=413,
            err_type="RequestEntityTooLarge",
        )

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large()
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body validated as ``model``; RequestError(400) naming the field otherwise
    (413 for a body over the limit)."""
    raw = await read_body(request)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"Invalid JSON in the request body: {e}") from e
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "null"}


def _field_path(loc: tuple[Any, ...]) -> str:
    """``("prompt", "list[int]", 0)`` -> ``"prompt.0"``: drop pydantic's union-member tags."""
    parts = [
        str(x)
        for x in loc
        if isinstance(x, int) or ("[" not in str(x) and str(x) not in _TYPE_TAGS)
    ]
    return ".".join(parts)


def validation_error(e: ValidationError) -> RequestError:
    """A 400 naming the first bad field; a value that fits none of a union's types gets one
    message, not one per member."""
    errors = e.errors()
    first = errors[0]
    loc = _field_path(tuple(first.get("loc", ())))
    union = [x for x in errors if _field_path(tuple(x.get("loc", ()))).startswith(loc)]
    if loc and len(union) > 1 and len(union) == len(errors):
        got = type(first.get("input")).__name__
        msg = f"{loc}: invalid value of type {got} ({first.get('msg', 'invalid value')}, ...)"
    else:
        more = len(errors) - 1
        msg = f"{loc}: {first.get('msg')}" if loc else str(first.get("msg"))
        msg += f" (and {more} more errors)" if more else ""
    return RequestError(msg, param=loc or None)


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def with_cancellation(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``, cancelling it if the client disconnects first (then returns None).
    The cancelled handler's ``finally`` blocks abort its engine requests."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    return None


def build_app(async_llm: AsyncLLMBase, args: Any = None) -> FastAPI:
    """The FastAPI app serving ``async_llm``.

    ``args`` is any object with (all optional) attributes ``served_model_name``, ``api_key``
    (``PAGEDLLM_API_KEY`` is used when it is unset), ``chat_template`` (path or Jinja text),
    ``enable_auto_tool_choice``, ``tool_call_parser``, ``reasoning_parser``, ``max_log_len``.
    The app adds a ``ServerMetrics`` stat logger to ``async_llm`` and, when xgrammar is
    installed, starts creating the structured-output manager on a helper thread.
    """
    model_name = (
        getattr(args, "served_model_name", None) or async_llm.model_config.served_model_name
    )
    api_key = getattr(args, "api_key", None) or os.environ.get("PAGEDLLM_API_KEY") or None
    chat_template = load_chat_template(getattr(args, "chat_template", None))
    metrics = ServerMetrics(model_name)
    async_llm.stat_loggers.append(metrics.record)
    if importlib.util.find_spec("xgrammar") is not None:
        async_llm.prepare_structured_outputs()  # tokenizer info ready before the first request
    drain = Drain(async_llm)
    completions = ServingCompletion(async_llm, model_name)
    chat = ServingChat(
        async_llm,
        model_name,
        chat_template,
        completions.longest_token,
        enable_auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        exclude_tools_when_tool_choice_none=bool(
            getattr(args, "exclude_tools_when_tool_choice_none", False)
        ),
    )
    completions.track = chat.track = drain.track
    models = ServingModels(async_llm, model_name)
    completions.models = chat.models = models
    responses_api = ServingResponses(chat)
    tokenizer = async_llm.tokenizer
    max_model_len = async_llm.model_config.max_model_len
    created = now()

    dashboard = None
    if getattr(args, "dashboard", True):
        from pagedllm.dashboard.service import DEFAULT_HZ, DashboardService

        hz = getattr(args, "dashboard_hz", None)
        hz = DEFAULT_HZ if hz is None else hz
        dashboard = DashboardService(async_llm, metrics, hz, stopping=lambda: drain.draining)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await async_llm.start()  # an engine core process: read its outputs on this loop
        if dashboard is not None:
            dashboard.start()
        try:
            yield
        finally:
            if dashboard is not None:
                await dashboard.close()

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.async_llm = async_llm
    app.state.metrics = metrics
    app.state.model_name = model_name
    app.state.drain = drain
    app.state.max_request_body_bytes = (
        getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_BODY_BYTES
    )
    app.state.dashboard = dashboard
    # innermost: the load's two endpoints skip FastAPI's layers (hot_path.py); filled below
    hot: dict[str, Endpoint] = {}
    app.add_middleware(HotRoutes, routes=hot, on_error=lambda r, e: _internal(r, e))
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(DrainMiddleware, drain=drain)  # outermost: counts every request
    if dashboard is not None:
        from pagedllm.dashboard.routes import add_dashboard

        add_dashboard(app, dashboard, api_key)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = {404: "NotFoundError", 405: "MethodNotAllowed"}.get(exc.status_code, "Error")
        response = error_response(RequestError(str(exc.detail), None, exc.status_code, err_type))
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        status, kind = (503, "ServiceUnavailable") if isinstance(exc, EngineDeadError) else (
            500, "InternalServerError")  # fmt: skip
        return error_response(RequestError(f"{type(exc).__name__}: {exc}", None, status, kind))

    async def respond(request: Request, result: Any) -> Response:
        if isinstance(result, dict):
            return JSONResponse(result)
        return SSEResponse(result)

    @app.post("/v1/completions", responses=responses(CompletionResponse, CompletionResponse))
    async def create_completion(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        return await handle(request, completions.create(req), bool(req.stream))

    @app.post("/v1/chat/completions",
              responses=responses(ChatCompletionResponse, ChatCompletionChunk))  # fmt: skip
    async def create_chat_completion(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        return await handle(request, chat.create(req), bool(req.stream))

    hot.update({"/v1/completions": create_completion,
                "/v1/chat/completions": create_chat_completion})  # fmt: skip

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req = await parse_body(request, ResponsesRequest)
        return await handle(request, responses_api.create(req), req.stream)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses_api.store.get(response_id)[0])

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> JSONResponse:
        responses_api.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def handle(request: Request, work: Awaitable[Any], stream: bool) -> Response:
        try:
            if stream:  # the SSE generator watches for the disconnect itself
                result = await work
            else:
                result = await with_cancellation(request, work)
                if result is None:  # client gone; nobody reads this
                    return Response(status_code=499)
        except (EngineError, EngineDeadError) as e:
            return error_response(internal_error(e))
        return await respond(request, result)

    @app.get("/v1/models", responses=responses(ModelList))
    async def list_models() -> JSONResponse:
        # (root: the served name, not the weights' path on the server's disk)
        return JSONResponse({"object": "list", "data": models.cards(created, max_model_len)})

    if runtime_updates_allowed():

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            body = await parse_body(request, LoRAAdapterRequest)
            return PlainTextResponse(await models.load(body.model_dump()))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            body = await parse_body(request, LoRAAdapterRequest)
            return PlainTextResponse(await models.unload(body.model_dump()))

    @app.get("/health", responses={200: {"description": "Ready"},
                                   503: {"description": "Draining or engine down"}})  # fmt: skip
    async def health() -> Response:
        ok = async_llm.is_running and not drain.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/version", responses=responses(VersionResponse))
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics", responses={200: {"description": "Prometheus text format"}})
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", responses=responses(TokenizeResponse))
    async def tokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, TokenizeRequest)
        chat.check_model(req.model)

        def work() -> dict[str, Any]:  # on the tokenizer thread, not the event loop
            if req.messages is not None:
                creq = ChatCompletionRequest(
                    messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                    add_special_tokens=req.add_special_tokens,
                )  # fmt: skip
                _, ids = chat.render(creq, ToolMode("none"))
            else:
                chat.check_text_fits(len(req.prompt), "prompt")
                add = req.add_special_tokens
                ids = list(tokenizer.encode(req.prompt, add_special_tokens=add))
            body: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len,
                                    "tokens": ids}  # fmt: skip
            if req.return_token_strs:
                body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
            return body

        return JSONResponse(await off_loop(work))

    @app.post("/detokenize", responses=responses(DetokenizeResponse))
    async def detokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, DetokenizeRequest)
        chat.check_model(req.model)
        vocab = async_llm.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"tokens out of vocabulary (size {vocab}): {bad[:5]}", "tokens")
        return JSONResponse({"prompt": tokenizer.decode(req.tokens)})

    install_request_bodies(
        app,
        {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
         "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest,
         "/detokenize": DetokenizeRequest},
        extra=[ChatCompletionChunk],
    )  # fmt: skip
    return app


def run_server(args: Any) -> int:
    """Load the model, then serve on ``args.host:args.port`` until interrupted; the exit
    status (1 if the engine core process or an API server process died).

    ``args`` is the namespace of ``pagedllm serve`` (see ``pagedllm.entrypoints.cli``). With
    ``engine_process`` (the default) the engine core runs in a process of its own
    (``MPAsyncLLM``); if it dies, the server stops accepting work and exits. With
    ``api_server_count`` N > 1, N - 1 more API server processes serve the same socket in
    front of the same core (``api_server_proc.py``).
    """
    import uvicorn

    engine_args = engine_args_from(args)
    # uvicorn stops on SIGTERM, then raises it again: exit through the cleanup below (the
    # API server processes, then the engine core, in order), with status 0
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, exit_cleanly)
    count = int(getattr(args, "api_server_count", 1) or 1)
    engine_process = getattr(args, "engine_process", True)
    if count < 1:
        raise ValueError(f"api_server_count must be at least 1, got {count}.")
    if count > 1 and not engine_process:
        raise ValueError("api_server_count > 1 needs the engine process (not --no-engine-process).")
    logger.info("loading %s", engine_args.model)
    died: list[str] = []
    workers: list[Any] = []
    # bound before anything slow: a port in use fails at once, and no process the engine
    # starts meanwhile (engine cores, workers, their gloo ranks on ephemeral ports) can take it
    listen = socket.create_server((args.host, args.port), backlog=2048)
    stopping = threading.Event()  # set when this server stops: its API servers may exit
    try:
        async_llm = _start_engine(args, engine_args, count, engine_process)
    except BaseException:
        listen.close()
        raise
    try:
        app = build_app(async_llm, args)
        if count > 1:
            workers = _start_api_servers(args, async_llm, listen)
        mc = async_llm.model_config
        logger.info(
            "serving %s (max_model_len %d, %d KV blocks) on http://%s:%d%s",
            app.state.model_name,
            mc.max_model_len,
            async_llm.stats()["num_blocks"],
            args.host,
            args.port,
            f" with {count} API server processes" if count > 1 else "",
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=getattr(args, "uvicorn_log_level", "info"),
            timeout_keep_alive=5,
        )
        server = DrainingServer(config, app.state.drain, shutdown_timeout_of(args))
        # the other API servers drain (or end) with this one
        server.on_signal.append(lambda sig: _signal_api_servers(workers, sig))

        def on_dead(message: str) -> None:
            died.append(message)
            server.should_exit = True

        if hasattr(async_llm, "on_dead"):
            async_llm.on_dead.append(on_dead)
        for proc in workers:
            threading.Thread(
                target=_watch_api_server, args=(proc, on_dead, stopping), daemon=True
            ).start()
        server.run(sockets=[listen])
    finally:
        stopping.set()
        _stop_api_servers(workers, timeout=shutdown_timeout_of(args) + 10.0)
        async_llm.shutdown()
        listen.close()
    if died:
        logger.error("exiting: %s", died[0])
        return 1
    return 0


def _start_engine(args: Any, engine_args: Any, count: int, engine_process: bool) -> AsyncLLMBase:
    """The server's engine: its core in a process of its own (one per data-parallel rank), or
    in this process without ``engine_process``."""
    if not engine_process:
        return AsyncLLM.from_engine_args(engine_args)
    from pagedllm.engine.mp_async_llm import MPAsyncLLM

    os.environ.setdefault("PAGEDLLM_LOG_LEVEL", str(getattr(args, "log_level", "INFO")))
    engine_config = engine_args.create_engine_config()
    dp = engine_config.parallel_config.data_parallel_size
    if dp > 1:
        from pagedllm.engine.dp_async_llm import DPAsyncLLM

        if count > 1:
            raise ValueError("api_server_count > 1 cannot be combined with data_parallel_size > 1.")
        async_llm: AsyncLLMBase = DPAsyncLLM(engine_config)
        logger.info("%d engine core processes ready in %.1f s", dp, async_llm.startup_seconds)
        return async_llm
    mp = MPAsyncLLM(engine_config, api_server_count=count)
    logger.info("engine core process %d ready in %.1f s", mp.core.pid, mp.startup_seconds)
    return mp


def _signal_api_servers(workers: list[Any], sig: int) -> None:
    """Pass a shutdown signal on to API servers 1..N-1 (they drain like this one)."""
    for proc, _ in workers:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.send_signal(sig)


def _start_api_servers(args: Any, llm: Any, listen: socket.socket) -> list[Any]:
    """Start API servers 1..N-1 (``api_server_proc.py``) on ``listen`` and the core's extra
    channels; return their processes once each has built its app."""
    from pagedllm.utils.child import start_child

    info = llm.core.info
    config = llm.config
    procs = []
    for index, chan in enumerate(llm.core.extra_channels, start=1):
        proc, init = start_child(
            "pagedllm.entrypoints.openai.api_server_proc",
            config.device_config.device,
            (listen.fileno(), chan.sock.fileno()),
        )
        chan.close()  # the child has it
        init.send((args, config, info, index))
        procs.append((proc, init))
    for proc, init in procs:
        try:
            kind, pid = init.recv(timeout=120)
        except (EOFError, OSError, TimeoutError) as e:
            raise RuntimeError(f"API server process {proc.pid} failed to start") from e
        assert kind == "ready", kind
    return procs


def _watch_api_server(worker: Any, on_dead: Any, stopping: threading.Event) -> None:
    proc, _ = worker
    code = proc.wait()
    if not stopping.is_set():
        on_dead(f"API server process {proc.pid} exited (exit code {code}).")


def _stop_api_servers(workers: list[Any], timeout: float = 10.0) -> None:
    import subprocess

    from pagedllm.utils.child import stop_process

    for _, init in workers:
        init.close()  # its end of file stops it (after its drain, if it is draining)
    for proc, _ in workers:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process(proc, 5.0)
