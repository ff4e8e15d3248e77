"""Structured outputs over HTTP: the request fields that ask for them, as one
``StructuredOutputsParams``, and the compiler's messages made readable.

Accepted (exactly one per request; two of them is a 400 naming the second):

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema": {"name": ...,
  "schema": {...}}}``;
- vLLM's older extras ``guided_json`` (a schema, as an object or a JSON string),
  ``guided_regex``, ``guided_choice`` (a non-empty list of strings), ``guided_grammar`` (EBNF,
  xgrammar's dialect);
- vLLM's newer ``structured_outputs`` object: ``{"json" | "json_object" | "regex" | "grammar" |
  "choice": ...}``.

``json_object`` (in ``response_format`` or ``structured_outputs``) means a JSON object, compiled
as the schema ``{"type": "object"}`` (vLLM does the same).

The grammar is compiled before the request is queued (``AsyncLLM.check_structured_outputs``, on
an executor thread): a schema, regex or grammar that does not compile is a 400 with the
compiler's message and the field's name as ``param``, before any byte is streamed.
"""

from __future__ import annotations

import re
from typing import Any

from pagedllm.entrypoints.openai.errors import RequestError
from pagedllm.structured_output.params import StructuredOutputsParams

_GUIDED = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)
FIELDS = ("response_format", *(name for name, _ in _GUIDED), "structured_outputs")

_ANY_OBJECT = {"type": "object"}

# xgrammar prefixes its messages with "[hh:mm:ss] /path/to/file.cc:123: ".
_XGR_PREFIX = re.compile(r"\[\d{2}:\d{2}:\d{2}\] \S+?:\d+: ")


def _response_format(rf: dict[str, Any]) -> dict[str, Any] | None:
    """The constraint of OpenAI's ``response_format`` (None for ``text``)."""
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, (dict, str)):
            raise RequestError(
                "response_format of type 'json_schema' needs json_schema.schema (a JSON schema "
                "object).",
                param="response_format",
            )
        return {"json": schema}
    raise RequestError(
        f"response_format.type must be one of 'text', 'json_object', 'json_schema'; got {kind!r}.",
        param="response_format",
    )


def structured_outputs_of(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the constraint, the field it came from) of a completion or chat request, or
    (None, None). RequestError (400, naming the field) when two fields ask for one, or when
    the one given is malformed (checked here; compiling comes later)."""
    given: list[tuple[str, dict[str, Any]]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            given.append(("response_format", spec))
    for name, key in _GUIDED:
        value = getattr(req, name)
        if value is not None:
            given.append((name, {key: value}))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", dict(req.structured_outputs)))
    if not given:
        return None, None
    if len(given) > 1:
        names = " and ".join(name for name, _ in given)
        allowed = ", ".join(FIELDS)
        raise RequestError(
            f"conflicting structured-output fields {names}: give only one of {allowed}.",
            param=given[1][0],
        )
    name, spec = given[0]
    try:
        params = StructuredOutputsParams.from_any(spec)
    except (ValueError, TypeError) as e:
        msg = str(e)
        if name != "structured_outputs":
            key = next(iter(spec))
            msg = msg.replace(f"structured_outputs.{key}", name)
        raise RequestError(msg, param=name) from e
    if params.json_object:
        # A JSON *object*, as OpenAI and vLLM mean it: the engine's json_object compiles
        # xgrammar's builtin JSON grammar, which also admits arrays, strings and numbers.
        params = StructuredOutputsParams(
            json=_ANY_OBJECT, disable_any_whitespace=params.disable_any_whitespace
        )
    return params, name


def compile_error_message(err: BaseException) -> str:
    """The compiler's message without xgrammar's time stamp and source location."""
    return _XGR_PREFIX.sub("", str(err)).strip()
