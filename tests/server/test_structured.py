"""Structured outputs over HTTP on the default model: every way of asking for them, outputs
that validate, and bad grammars answered with a 400 before anything runs, while well-formed
constrained requests next to them are unaffected."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
PERSON = {
    "type": "object",
    "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "city": NAME,
        "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 2},
        "status": {"enum": ["open", "closed"]},
    },
    "required": ["city", "tags", "status"],
    "additionalProperties": False,
}
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
CHOICES = ["positive", "negative", "neutral"]
SUM_EBNF = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
MSGS = [{"role": "user", "content": "Describe a person as JSON."}]
ONE_MB_SCHEMA = {"type": "object", "description": "x" * (1 << 20)}

# (body fields, the param a 400 must name, a fragment of the message)
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"guided_json": {"type": "object", "properties": 5}}, "guided_json", "properties"),
    ({"guided_json": "{not json"}, "guided_json", "invalid json"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "integr"}},
            }
        },
        "response_format",
        "integr",
    ),  # fmt: skip
    ({"guided_regex": "([a-z"}, "guided_regex", "invalid regex"),
    ({"guided_regex": "a{3,1}"}, "guided_regex", "invalid regex"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "invalid grammar"),
    (
        {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
        "structured_outputs",
        "grammar",
    ),  # fmt: skip
    ({"guided_choice": []}, "guided_choice", "guided_choice must be a non-empty list"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown fields"),
    (
        {"guided_json": {"type": "object", "description": "x" * (3 << 20)}},
        "guided_json",
        "bytes",
    ),  # fmt: skip
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "conflicting"),
    (
        {"response_format": {"type": "json_object"}, "guided_json": PERSON},
        "guided_json",
        "conflicting",
    ),  # fmt: skip
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        "schema",
    ),  # fmt: skip
]


def _post(server: LiveServer, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + route, json=body, headers=server.headers, timeout=60)


def _chat(client, server: LiveServer, **kw: Any) -> str:  # noqa: ANN001
    out = client.chat.completions.create(
        model=server.model, messages=MSGS, max_tokens=kw.pop("max_tokens", 120), **kw
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    return out.choices[0].message.content


def test_every_way_to_ask(server: LiveServer, client) -> None:  # noqa: ANN001
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    jsonschema.validate(json.loads(_chat(client, server, response_format=fmt)), PERSON)
    obj = client.chat.completions.create(
        model=server.model, messages=MSGS, max_tokens=40, temperature=0,
        response_format={"type": "json_object"},
    ).choices[0]  # fmt: skip
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)
    else:  # a long object cut by max_tokens is still a JSON prefix starting with "{"
        assert obj.message.content.lstrip().startswith("{")
    text = _chat(client, server, extra_body={"guided_json": json.dumps(CITY)}, temperature=1.0,
                 seed=3)  # fmt: skip
    jsonschema.validate(json.loads(text), CITY)
    assert re.fullmatch(DATE, _chat(client, server, extra_body={"guided_regex": DATE}))
    assert _chat(client, server, extra_body={"guided_choice": CHOICES}) in CHOICES
    grammar = _chat(client, server, extra_body={"guided_grammar": SUM_EBNF}, temperature=1.0,
                    seed=1)  # fmt: skip
    assert re.fullmatch(r"\((\d{1,2})(\+\d{1,2})*\)", grammar)
    out = client.completions.create(
        model=server.model, prompt="Pick one:", max_tokens=8, temperature=1.0, seed=2, n=2,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )  # fmt: skip
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in out.choices)
    stream = client.completions.create(
        model=server.model, prompt="A date:", max_tokens=20, stream=True,
        extra_body={"structured_outputs": {"regex": DATE}},
    )  # fmt: skip
    assert re.fullmatch(DATE, "".join(c.choices[0].text for c in stream))
    plain = client.chat.completions.create(
        model=server.model, messages=MSGS, max_tokens=5, temperature=0,
        response_format={"type": "text"},
    )  # fmt: skip
    assert plain.choices[0].message.content.startswith("A JSON")  # unconstrained


@pytest.mark.parametrize("fields, param, fragment", BAD)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_bad_grammar_is_a_400(
    server: LiveServer, route: str, fields: dict, param: str, fragment: str
) -> None:
    base = {"prompt": "x"} if route == "/v1/completions" else {"messages": MSGS}
    r = _post(server, route, {**base, "max_tokens": 4, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err
    assert "/project/" not in err["message"]  # xgrammar's source location is stripped
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_bad_grammar_when_streaming_is_a_400_not_a_stream(server: LiveServer) -> None:
    body = {"prompt": "x", "max_tokens": 4, "stream": True, "guided_regex": "(unclosed"}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=server.headers
    ) as r:
        assert r.status_code == 400
        assert r.headers["content-type"].startswith("application/json")
        r.read()
    assert "invalid regex" in r.json()["error"]["message"]


def test_one_megabyte_description_gets_a_clear_answer(server: LiveServer) -> None:
    """Under the engine's 2 MB cap: compiled (the description does not constrain) and served,
    quickly; either way the answer is a complete response, not a hang."""
    t = time.monotonic()
    r = _post(server, "/v1/completions", {"prompt": "{", "max_tokens": 4,
                                          "guided_json": ONE_MB_SCHEMA})  # fmt: skip
    assert time.monotonic() - t < 30
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "guided_json"
    else:
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_good_and_bad_side_by_side(server: LiveServer) -> None:
    """Well-formed constrained requests (streaming and not) run concurrently with malformed
    ones: every bad one is a 400, every good one completes and validates."""

    async def good(ac: openai.AsyncOpenAI, i: int) -> None:
        kind = i % 4
        extra: dict[str, Any] = {}
        check: Any
        if kind == 0:
            extra = {"guided_json": PERSON if i % 8 == 0 else CITY}
            schema = extra["guided_json"]

            def check(t: str) -> None:
                jsonschema.validate(json.loads(t), schema)
        elif kind == 1:
            extra = {"guided_regex": DATE}

            def check(t: str) -> None:
                assert re.fullmatch(DATE, t), t
        elif kind == 2:
            extra = {"guided_choice": CHOICES}

            def check(t: str) -> None:
                assert t in CHOICES, t
        else:
            fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
            extra = {"response_format": fmt}

            def check(t: str) -> None:
                jsonschema.validate(json.loads(t), PERSON)

        kw = dict(model=server.model, messages=MSGS, max_tokens=120, temperature=1.0, seed=i,
                  extra_body=extra)  # fmt: skip
        if i % 2:
            text, finish = "", None
            async for chunk in await ac.chat.completions.create(**kw, stream=True):
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        else:
            out = await ac.chat.completions.create(**kw)
            text, finish = out.choices[0].message.content, out.choices[0].finish_reason
        assert finish == "stop", text
        check(text)

    async def bad(ac: openai.AsyncOpenAI, fields: dict[str, Any], param: str) -> None:
        try:
            await ac.chat.completions.create(
                model=server.model, messages=MSGS, max_tokens=8, extra_body=fields
            )
        except openai.BadRequestError as e:
            assert e.body["param"] == param
            return
        raise AssertionError(f"{fields} was accepted")

    async def run() -> None:
        async with server.async_client(max_retries=0, timeout=300) as ac:
            await asyncio.gather(
                *(good(ac, i) for i in range(8)),
                *(bad(ac, f, p) for f, p, _ in BAD[:9]),
            )

    asyncio.run(run())
    server.wait_idle()
    assert httpx.get(f"{server.url}/health").status_code == 200
