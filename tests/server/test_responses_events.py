"""The Responses stream's event writer on its own: shaped pieces of reasoning, answer text and
tool calls become OpenAI's output-item events in order (one item open at a time, each closed
with its done events), and the final output items carry the same ids and text."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.reasoning import get_reasoning_format
from pagedllm.entrypoints.openai.responses import ServingResponses, _ItemWriter
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser
from pagedllm.entrypoints.openai.tools import ChoiceShaper, parse_tools, resolve_tool_choice


def test_events_of_reasoning_text_and_a_call() -> None:
    tools = parse_tools([{"type": "function", "function": {"name": "f"}}])
    mode = resolve_tool_choice(tools, "auto", None, True)
    shaper = ChoiceShaper(mode, HermesToolParser(), get_reasoning_format("qwen3"), None)
    seq: list[dict] = []

    def event(kind: str, **fields: object) -> str:
        seq.append({"type": kind, **fields})
        return kind

    writer = _ItemWriter(event)
    text = '<think>plan</think>Calling. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    for k, piece in enumerate(pieces):
        writer.write(shaper.step(piece, k == len(pieces) - 1))
    writer.close()
    kinds = [e["type"] for e in seq]
    assert kinds[0] == "response.output_item.added" and seq[0]["item"]["type"] == "reasoning"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert kinds.index("response.output_text.done") < kinds.index(
        "response.function_call_arguments.done")  # fmt: skip
    def joined(kind: str) -> str:
        return "".join(e["delta"] for e in seq if e["type"] == kind)

    assert joined("response.reasoning_text.delta") == "plan"
    assert joined("response.output_text.delta") == "Calling. "
    done = [e["item"] for e in seq if e["type"] == "response.output_item.done"]
    assert [d["type"] for d in done] == ["reasoning", "message", "function_call"]
    assert [e["output_index"] for e in seq if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert json.loads(done[2]["arguments"]) == {"x": 1} and done[2]["name"] == "f"
    items = ServingResponses._items(shaper, writer.ids)
    assert [(i["type"], i["id"]) for i in items] == [(d["type"], d["id"]) for d in done]
    assert items[1]["content"][0]["text"] == "Calling. "
