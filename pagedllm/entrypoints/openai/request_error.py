"""``RequestError``: a client error and its HTTP status, raised anywhere in the server and
answered with OpenAI's error body by ``errors.py``. A module of its own, free of the server
packages, so the parts of the front end that are plain logic (``tools.py``) import without
FastAPI or pydantic (a GPU benchmark uses them)."""

from __future__ import annotations


class RequestError(Exception):
    """A client error: becomes an OpenAI error body with ``status_code``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status_code: int = 400,
        err_type: str = "BadRequestError",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.err_type = err_type
