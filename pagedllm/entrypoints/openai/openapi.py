"""Typed schemas of the server's OpenAPI document (``/openapi.json``, ``/docs``).

The handlers read the raw body themselves (a size limit before parsing, OpenAI error bodies,
unknown fields ignored) and build responses as plain dicts (faster to stream), so FastAPI sees
no types. This module gives the document what a client generator needs: each route's request
body (the pydantic request models of ``protocol.py``) and its responses (the models below,
which tests check real responses against), errors included.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import ErrorResponse


class Usage(BaseModel):
    """Tokens of a response; ``prompt_tokens_details.cached_tokens`` is the prefix-cache hit."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions' logprobs (``logprobs: N``)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One sequence of a completion (``stop_reason``: the stop string or token id, vLLM's)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """``POST /v1/completions``; streamed, each ``data:`` event has this shape (one choice,
    ``usage`` only in the last event when ``stream_options.include_usage``)."""

    id: str
    object: str  # "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    """One alternative token of a chat logprob entry."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    """A generated token's logprob and its top alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class FunctionCall(BaseModel):
    name: str | None = None  # (a streamed call's later deltas carry only arguments)
    arguments: str


class ToolCall(BaseModel):
    """A function call in a reply (``tool_calls[i]``); streamed, ``index`` says which call a
    delta adds to and only its first delta has ``id``, ``type`` and the name."""

    index: int | None = None
    id: str | None = None
    type: str | None = None  # "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None  # --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    """One sequence of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """``POST /v1/chat/completions`` (non-streaming)."""

    id: str
    object: str  # "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a streamed chat completion (``object``: "chat.completion.chunk")."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: str  # "model"
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: str  # "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """``POST /tokenize``."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """``POST /detokenize``."""

    prompt: str


class VersionResponse(BaseModel):
    version: str


_ERRORS: dict[int, str] = {
    400: "Invalid request (the field is named in ``error.param``)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    413: "Request body over ``--max-request-body-bytes``",
    500: "The engine failed on this request",
    503: "The server is shutting down or its engine is not running",
}


def responses(ok: type[BaseModel] | None, stream: type[BaseModel] | None = None,
              ok_text: str = "Success") -> dict[int | str, dict[str, Any]]:  # fmt: skip
    """A route's ``responses`` argument: ``ok`` as the 200 body (JSON), ``stream`` as the shape
    of each server-sent event when streaming, and OpenAI error bodies."""
    out: dict[int | str, dict[str, Any]] = {}
    if ok is not None:
        out[200] = {"model": ok, "description": ok_text}
        if stream is not None:
            out[200]["content"] = {"text/event-stream": {
                "schema": {"type": "string"},
                "description": f"``data: <{stream.__name__} JSON>`` events, then ``data: [DONE]``",
            }}  # fmt: skip
    for code, text in _ERRORS.items():
        out[code] = {"model": ErrorResponse, "description": text}
    return out


def install_request_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]],
                           extra: list[type[BaseModel]]) -> None:  # fmt: skip
    """Make ``app.openapi()`` document each POST route's JSON body as its model (``bodies``:
    path -> model) and list ``extra`` models (stream events) among the components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                          description=app.description)  # fmt: skip
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        ref = "#/components/schemas/{model}"
        for model in [*bodies.values(), *extra]:
            schema = model.model_json_schema(ref_template=ref)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        for path, model in bodies.items():
            op = doc["paths"][path]["post"]
            body_schema = {"$ref": ref.format(model=model.__name__)}
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": body_schema}},
            }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
