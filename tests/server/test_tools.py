"""Tool calling over HTTP on the default model, with the official ``openai`` client: every
``tool_choice`` mode streaming and not, arguments that parse and match their schema under
``required`` and a named function, hermes-format calls found under ``auto``, the tools and the
tool-call history reaching the chat template, and bad tool requests answered with a 400 that
names the field while the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import LiveServer

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 16},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "minLength": 1, "maxLength": 16}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
# Under "auto" the model writes calls in its own format; a regex makes SmolLM2 write one.
HERMES_CALL = (
    r'Ok\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "c"\}\}'
    r"\n</tool_call>"
)


def _create(client: Any, server: LiveServer, stream: bool, **kw: Any) -> dict[str, Any]:
    """One chat completion as {"content", "reasoning", "tool_calls", "finish_reason"}; a
    stream's deltas are put together the way the openai client's users do (by call index)."""
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 160)
    kw.setdefault("temperature", 0.0)
    if not stream:
        r = client.chat.completions.create(model=server.model, **kw)
        m = r.choices[0].message
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in m.tool_calls or []
        ]
        return {"content": m.content, "tool_calls": calls,
                "finish_reason": r.choices[0].finish_reason}  # fmt: skip
    content, calls, finish = None, {}, None
    for chunk in client.chat.completions.create(model=server.model, stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        if d.content:
            content = (content or "") + d.content
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                call["id"] = tc.id
            if tc.function and tc.function.name:
                call["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "tool_calls": [calls[i] for i in sorted(calls)],
            "finish_reason": finish}  # fmt: skip


def _check_calls(calls: list[dict[str, Any]]) -> None:
    """Every call names a tool, has an id, and its arguments parse and match the schema."""
    assert calls
    for c in calls:
        assert c["id"] and c["name"] in SCHEMAS
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def _strip_ids(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) for c in calls]


def test_required_calls_parse_streaming_and_not(client, server: LiveServer) -> None:  # noqa: ANN001
    whole = _create(client, server, False, tools=TOOLS, tool_choice="required")
    streamed = _create(client, server, True, tools=TOOLS, tool_choice="required")
    for r in (whole, streamed):
        _check_calls(r["tool_calls"])
        assert r["finish_reason"] == "tool_calls" and not r["content"]
    assert _strip_ids(whole["tool_calls"]) == _strip_ids(streamed["tool_calls"])  # greedy
    one = _create(client, server, False, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False)  # fmt: skip
    _check_calls(one["tool_calls"])
    assert len(one["tool_calls"]) == 1


def test_required_with_n_2_streams_each_choice_apart(client, server: LiveServer) -> None:  # noqa: ANN001
    calls: dict[int, dict[int, dict[str, str]]] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(
        model=server.model, messages=MSGS, tools=TOOLS, tool_choice="required", n=2,
        parallel_tool_calls=False,
        temperature=1.0, seed=5, max_tokens=160, stream=True,
    ):  # fmt: skip
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(ch.index, {}).setdefault(tc.index, {"name": "", "args": ""})
                c["name"] += (tc.function.name or "") if tc.function else ""
                c["args"] += (tc.function.arguments or "") if tc.function else ""
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert sorted(calls) == [0, 1] and finish == {0: "tool_calls", 1: "tool_calls"}
    for per_choice in calls.values():
        _check_calls([{"id": "x", "name": c["name"], "arguments": c["args"]}
                      for c in per_choice.values()])  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_named_function(client, server: LiveServer, stream: bool) -> None:  # noqa: ANN001
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = _create(client, server, stream, tools=TOOLS, tool_choice=choice)
    _check_calls(r["tool_calls"])
    assert [c["name"] for c in r["tool_calls"]] == ["get_time"]
    assert r["finish_reason"] == "stop" and not r["content"]  # as OpenAI and vLLM


@pytest.mark.parametrize("stream", [False, True])
def test_auto_finds_the_models_calls(client, server: LiveServer, stream: bool) -> None:  # noqa: ANN001
    # no tool_choice: "auto", OpenAI's default when tools are given
    r = _create(client, server, stream, tools=TOOLS, extra_body={"guided_regex": HERMES_CALL})
    assert r["content"] == "Ok. "
    _check_calls(r["tool_calls"])
    assert [c["name"] for c in r["tool_calls"]] == ["get_weather"]
    assert json.loads(r["tool_calls"][0]["arguments"])["unit"] == "c"
    assert r["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_without_a_call_and_a_call_that_does_not_parse(client, server: LiveServer,  # noqa: ANN001
                                                            stream: bool) -> None:  # fmt: skip
    r = _create(client, server, stream, tools=TOOLS, tool_choice="auto",
                extra_body={"guided_choice": ["It is sunny."]})  # fmt: skip
    assert r == {"content": "It is sunny.", "tool_calls": [], "finish_reason": "stop"}
    broken = "<tool_call>\n{broken\n</tool_call>"
    r = _create(client, server, stream, tools=TOOLS, tool_choice="auto",
                extra_body={"guided_choice": [broken]})  # fmt: skip
    assert r == {"content": broken, "tool_calls": [], "finish_reason": "stop"}  # text kept


def test_none_keeps_text_and_the_template_gets_the_tools(client, server: LiveServer) -> None:  # noqa: ANN001
    r = _create(client, server, False, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r["tool_calls"] == [] and r["finish_reason"] == "length"
    # a template that renders only the tools' names and the history's tool fields: the
    # prompt's token count shows what reached it
    template = (
        "{% for t in tools %}{{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}="
        "{{ m.tool_calls[0].function.arguments.city }};{% endif %}"
        "{% if m.role == 'tool' %}{{ m.tool_call_id }}:{{ m.content }};{% endif %}{% endfor %}"
    )
    history = [
        *MSGS,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]  # fmt: skip
    resp = client.chat.completions.create(
        model=server.model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1,
        extra_body={"chat_template": template},
    )  # fmt: skip
    expect = "get_weather;get_time;get_weather=Paris;call_1:18 C;"
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": expect, "add_special_tokens": False},
                     headers=server.headers, timeout=30).json()  # fmt: skip
    assert resp.usage.prompt_tokens == tok["count"]


def test_bad_tool_requests_are_400s_naming_the_field(server: LiveServer) -> None:
    url = f"{server.url}/v1/chat/completions"
    base = {"model": server.model, "messages": MSGS, "max_tokens": 4}
    bad_call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}
    bad_args = [{"role": "assistant", "content": None, "tool_calls": [bad_call]}]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "integr"}}}], "tool_choice": "required"}, "tools"),
        ({"messages": [*MSGS, *bad_args]}, "messages"),
        ({"tools": TOOLS, "tool_choice": "required", "use_beam_search": True, "n": 2},
         "tool_choice"),
    ]  # fmt: skip
    with httpx.Client(headers=server.headers, timeout=60) as http:
        for body, param in cases:
            r = http.post(url, json={**base, **body})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)
        ok = http.post(url, json={**base, "tools": TOOLS, "tool_choice": "required",
                                  "max_tokens": 120})  # fmt: skip
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"]
        # the reply is what /openapi.json documents, tool calls included
        from pagedllm.entrypoints.openai import openapi

        msg = openapi.ChatCompletionResponse.model_validate(ok.json()).choices[0].message
        assert msg.tool_calls and msg.tool_calls[0].function.name in SCHEMAS
