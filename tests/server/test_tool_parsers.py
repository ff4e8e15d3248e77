"""The tool-call parsers, the required-list stream and the reasoning splitter on their own
(no server): each format parsed whole, and the same result however the text is cut into
deltas (every split point), with text that looks like a tag held back, not lost."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.reasoning import (
    ReasoningSplitter,
    get_reasoning_format,
    split_reasoning,
)
from pagedllm.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    RequiredListStream,
    ToolParser,
    get_tool_parser,
)

CASES: list[tuple[type[ToolParser], str, str, list[tuple[str, dict]]]] = [
    (HermesToolParser,
     'Sure <tool_c. <tool_call>\n{"name": "f", "arguments": {"a": "<tool_call>"}}\n</tool_call>'
     '\n<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}</tool_call>',
     "Sure <tool_c. \n", [("f", {"a": "<tool_call>"}), ("g", {"b": 2})]),
    (HermesToolParser, "no calls at all <tool", "no calls at all <tool", []),
    (HermesToolParser, "x<tool_call>{oops}</tool_call>y", "x<tool_call>{oops}</tool_call>y", []),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {}}', "", [("f", {})]),  # cut
    (Llama3JsonToolParser,
     '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "",
     [("f", {"a": 1}), ("g", {})]),
    (Llama3JsonToolParser, ' {"name": "f", "parameters": {"a": [1, 2]}}', "",
     [("f", {"a": [1, 2]})]),
    (Llama3JsonToolParser, "Paris is {big}.", "Paris is {big}.", []),
    (Llama3JsonToolParser, "{not json", "{not json", []),
    (MistralToolParser, 'ok [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "ok ",
     [("f", {"a": 1})]),
    (MistralToolParser, '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', "",
     [("f", {"a": 1}), ("g", {})]),
    (MistralToolParser, "[TOOL_CALLS]nonsense", "[TOOL_CALLS]nonsense", []),
    (PythonicToolParser, '[get_weather(city="Paris", days=[1, 2]), now()]', "",
     [("get_weather", {"city": "Paris", "days": [1, 2]}), ("now", {})]),
    (PythonicToolParser, '<|python_start|>[f(a=None, b={"x": 1.5})]<|python_end|>', "",
     [("f", {"a": None, "b": {"x": 1.5}})]),
    (PythonicToolParser, "[f(__import__('os'))]", "[f(__import__('os'))]", []),  # not literal
    (PythonicToolParser, "[f(x=open('y'))]", "[f(x=open('y'))]", []),
    (PythonicToolParser, "Sure: [f(a=1)]", "Sure: [f(a=1)]", []),
]  # fmt: skip


def _by_deltas(cls: type[ToolParser], text: str, cut: int) -> tuple[str, list]:
    p = cls()
    c1, t1 = p.feed(text[:cut])
    c2, t2 = p.feed(text[cut:])
    c3, t3 = p.finish()
    return c1 + c2 + c3, t1 + t2 + t3


@pytest.mark.parametrize("cls,text,content,calls", CASES)
def test_parsers_whole_and_by_deltas(cls, text, content, calls) -> None:  # noqa: ANN001
    for cut in [None, *range(len(text) + 1)]:
        got_content, got = cls().parse(text) if cut is None else _by_deltas(cls, text, cut)
        assert got_content == content, cut
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls, cut
        assert len({c.id for c in got}) == len(got)
    if cls is MistralToolParser and calls:
        assert all(len(c.id) == 9 and c.id.isalnum() for c in cls().parse(text)[1])


def test_qwen3_xml_types_values_by_the_schema() -> None:
    text = (
        "Let me look.\n<tool_call>\n<function=search>\n<parameter=query>\nred <b>\nshoes\n"
        "</parameter>\n<parameter=top_k>\n5\n</parameter>\n<parameter=exact>\nTrue\n"
        "</parameter>\n<parameter=filters>\n{\"size\": [9, 10]}\n</parameter>\n"
        "<parameter=note>\n12\n</parameter>\n</function>\n</tool_call>"
    )
    schema = {"properties": {"query": {"type": "string"}, "top_k": {"type": "integer"},
                             "exact": {"type": "boolean"}, "filters": {"type": "object"},
                             "note": {"type": "string"}}}  # fmt: skip
    want = {"query": "red <b>\nshoes", "top_k": 5, "exact": True,
            "filters": {"size": [9, 10]}, "note": "12"}  # fmt: skip
    assert get_tool_parser("qwen3_coder") is get_tool_parser("qwen3_xml")
    for cut in range(len(text) + 1):
        p = get_tool_parser("qwen3_xml")()
        p.schemas = {"search": schema}
        c1, t1 = p.feed(text[:cut])
        c2, t2 = p.feed(text[cut:])
        c3, t3 = p.finish()
        assert c1 + c2 + c3 == "Let me look.\n", cut
        calls = t1 + t2 + t3
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", want)], cut
    broken = "<tool_call>\n<function search>\n</tool_call>"
    assert get_tool_parser("qwen3_xml")().parse(broken) == (broken, [])


def test_unknown_parser_names_the_choices() -> None:
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def test_required_list_streams_arguments_in_order() -> None:
    text = ('[{"name": "f", "parameters": {"s": "a\\"}b", "n": [1, {"x": 2}]}}, '
            '{"parameters": {"z": "UTC"}, "name": "g"}]')  # fmt: skip
    want = [("f", {"s": 'a"}b', "n": [1, {"x": 2}]}), ("g", {"z": "UTC"})]
    for cut in range(len(text) + 1):
        r = RequiredListStream()
        deltas = r.feed(text[:cut]) + r.feed(text[cut:])
        assert [(c.name, json.loads(c.arguments)) for c in r.calls] == want, cut
        rebuilt: dict[int, str] = {}  # what a client adds up from the deltas
        for d in deltas:
            rebuilt[d["index"]] = rebuilt.get(d["index"], "") + d["function"]["arguments"]
            assert ("id" in d) == (d["function"].get("name") is not None)
        assert [rebuilt[i] for i in sorted(rebuilt)] == [c.arguments for c in r.calls]


@pytest.mark.parametrize("parser,prompt,text,reasoning,answer", [
    ("qwen3", "", "<think>\nhm </th </think>\n\nYes", "\nhm </th ", "\n\nYes"),
    ("qwen3", "", "Yes, no thinking", None, "Yes, no thinking"),
    ("qwen3", "", "<think>cut before the end", "cut before the end", ""),
    ("qwen3", "assistant\n<think>\n", "a</think>b", "a", "b"),
    ("qwen3", "<think>\n\n</think>\n\n", "x</think>y", None, "x</think>y"),
    ("deepseek_r1", "", "a</think>b", "a", "b"),
    ("deepseek_r1", "", "<think>a</think>b", "a", "b"),
])  # fmt: skip
def test_reasoning_split(parser, prompt, text, reasoning, answer) -> None:  # noqa: ANN001
    fmt = get_reasoning_format(parser)
    assert split_reasoning(fmt, text, prompt) == (reasoning, answer)
    for cut in range(len(text) + 1):
        s = ReasoningSplitter(fmt, prompt)
        parts = [s.feed(text[:cut]), s.feed(text[cut:]), s.finish()]
        assert "".join(p[0] for p in parts) == (reasoning or ""), cut
        assert "".join(p[1] for p in parts) == answer, cut
