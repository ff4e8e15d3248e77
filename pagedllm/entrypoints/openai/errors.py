"""The OpenAI error body: ``RequestError`` (a client error and its HTTP status), the body's
pydantic models and ``error_response``, which every part of the server that answers an
error (route handlers, the API-key and drain middlewares, streams) builds its reply with."""

from __future__ import annotations

from pydantic import BaseModel
from starlette.responses import JSONResponse

from pagedllm.entrypoints.openai.request_error import RequestError

__all__ = ["ErrorInfo", "ErrorResponse", "RequestError", "error_response"]


class ErrorInfo(BaseModel):
    """OpenAI's error object. ``type`` and ``code`` follow vLLM: the error class name and the
    HTTP status (e.g. ``"BadRequestError"``, 400; ``"NotFoundError"``, 404)."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo

    @classmethod
    def of(cls, err: RequestError) -> ErrorResponse:
        return cls(
            error=ErrorInfo(
                message=err.message, type=err.err_type, param=err.param, code=err.status_code
            )
        )


def error_response(err: RequestError) -> JSONResponse:
    """OpenAI's error body with the error's HTTP status."""
    return JSONResponse(ErrorResponse.of(err).model_dump(), status_code=err.status_code)
