"""``/v1/responses`` on the default model with the official ``openai`` client: a two-turn
conversation through ``previous_response_id`` (the second turn's prompt is the first turn's
conversation), streaming events that add up to the final response, a tool call answered by a
``function_call_output`` in the next turn, JSON output by ``text.format``, stored responses,
and errors in OpenAI's format."""

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
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_two_turns_carry_the_conversation(client, server: LiveServer) -> None:  # noqa: ANN001
    first = client.responses.create(model=server.model, input="Name a fruit.",
                                    instructions="Answer briefly.", max_output_tokens=12,
                                    temperature=0)  # fmt: skip
    assert first.id.startswith("resp_") and first.output_text
    cut = first.usage.output_tokens == 12
    assert first.status == ("incomplete" if cut else "completed")
    assert (first.incomplete_details is not None) == cut
    second = client.responses.create(model=server.model, input="And a colour?",
                                     previous_response_id=first.id, max_output_tokens=4,
                                     temperature=0)  # fmt: skip
    assert second.previous_response_id == first.id
    # the same conversation as chat messages (the first turn's instructions are not carried)
    chat = client.chat.completions.create(model=server.model, max_tokens=4, temperature=0,
                                          messages=[
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And a colour?"},
    ])  # fmt: skip
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content  # greedy
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text


def test_streaming_events_add_up(client, server: LiveServer) -> None:  # noqa: ANN001
    events = list(client.responses.create(model=server.model, input="Say hello.",
                                          max_output_tokens=10, temperature=0,
                                          stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.incomplete", "response.completed")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [d.item.id for d in done] == [o.id for o in final.output]
    whole = client.responses.create(model=server.model, input="Say hello.", max_output_tokens=10,
                                    temperature=0)  # fmt: skip
    assert whole.output_text == final.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_and_its_output(client, server: LiveServer, stream: bool) -> None:  # noqa: ANN001
    kw: dict[str, Any] = dict(model=server.model, input="Weather in Paris?", tools=[WEATHER],
                              tool_choice="required", max_output_tokens=60,
                              temperature=0)  # fmt: skip
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        r = events[-1].response
        args = "".join(e.delta for e in events
                       if e.type == "response.function_call_arguments.delta")  # fmt: skip
        assert r.status == "completed"
        assert "response.function_call_arguments.done" in [e.type for e in events]
    else:
        r = client.responses.create(**kw)
        args = None
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    if args is not None:
        assert args == "".join(c.arguments for c in calls)
    follow = client.responses.create(
        model=server.model, previous_response_id=r.id, max_output_tokens=4, temperature=0,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "18 C"}
               for c in calls],
    )  # fmt: skip
    assert follow.output_text and not [o for o in follow.output if o.type == "function_call"]


def test_json_output_by_text_format(client, server: LiveServer) -> None:  # noqa: ANN001
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    r = client.responses.create(model=server.model, input="Is water wet? Answer in JSON.",
                                max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer",
                                                 "schema": schema}})  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)


def test_errors_and_the_store(server: LiveServer) -> None:
    url = f"{server.url}/v1/responses"
    with httpx.Client(headers=server.headers, timeout=60) as http:
        cases: list[tuple[dict[str, Any], int, str | None]] = [
            ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
            ({"input": [{"type": "image_generation_call"}]}, 400, "input"),
            ({"input": []}, 400, "input"),
            ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
            ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
            ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
            ({"input": "hi", "background": True}, 400, "background"),
            ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                 "schema": {"type": "integr"}}}}, 400, "text"),
        ]  # fmt: skip
        for body, status, param in cases:
            r = http.post(url, json={"model": server.model, "max_output_tokens": 4, **body})
            assert r.status_code == status, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)
        made = http.post(url, json={"model": server.model, "input": "hi", "max_output_tokens": 2})
        rid = made.json()["id"]
        assert http.get(f"{url}/{rid}").json()["id"] == rid
        assert http.delete(f"{url}/{rid}").json()["deleted"] is True
        assert http.get(f"{url}/{rid}").status_code == 404
        unstored = http.post(url, json={"model": server.model, "input": "hi", "store": False,
                                        "max_output_tokens": 2}).json()  # fmt: skip
        assert http.get(f"{url}/{unstored['id']}").status_code == 404
