"""Tool-call parsers (``--tool-call-parser``, vLLM's names): the calls a model writes in its own
format, found in its output, as whole replies and as streamed deltas.

- ``hermes`` (Qwen2.5, Qwen3, Hermes 2/3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>``, any number of them, text before them is content.
- ``llama3_json`` (Llama 3.1/3.2/3.3): the output is one or more JSON objects
  ``{"name": ..., "parameters": {...}}`` separated by ``;``, optionally after
  ``<|python_tag|>``; an output that does not open with one of those is all content.
- ``mistral``: content, then ``[TOOL_CALLS]`` and either a JSON list of ``{"name", "arguments"}``
  (tokenizers up to v7) or ``name[ARGS]{...}`` per call (v11 and later).
- ``pythonic`` (Llama 3.2, Llama 4): the output is a Python list of calls with keyword
  arguments, ``[get_weather(city="Paris")]``, read with ``ast`` (literals only).
- ``qwen3_xml`` / ``qwen3_coder`` (Qwen3-Coder): ``<tool_call><function=NAME><parameter=KEY>
  VALUE</parameter></function></tool_call>``, values typed by the tool's schema.

A parser reads one choice's text delta by delta (``feed``) and hands back the content that is
certainly not part of a call, and each call once it is complete (a streamed call arrives in one
delta with its whole arguments, which OpenAI's format allows). Text that might open a call is
held back until the next delta decides. A call that does not parse is given back as content,
tags and all, so nothing the model wrote is lost (issue: "a reply whose content carries the
text").
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any


def tool_call_id() -> str:
    """An id for a call the server found (vLLM's form)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_tool_call_id() -> str:
    """Mistral's chat templates accept 9 alphanumeric characters only."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


@dataclass
class ToolCall:
    """One function call: its name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``message.tool_calls[i]``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call_of(obj: Any, args_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """A ToolCall from a decoded ``{"name": ..., <args key>: {...}}``, or None if malformed."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def split_held(text: str, tag: str) -> tuple[str, str]:
    """(the text certainly not part of ``tag``, the tail that may turn out to begin it once
    the next delta comes). Example: ("Sure <tool", "<tool_call>") -> ("Sure ", "<tool")."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k], text[-k:]
    return text, ""


class ToolParser:
    """Finds the tool calls in one choice's output. Subclasses implement ``feed``/``finish``."""

    name = ""
    # the format's markers are special tokens: the detokenizer must keep them
    needs_special_tokens = False
    # the request's tools' parameter schemas by function name (formats that write arguments
    # as text, e.g. qwen3_xml, read their types from them)
    schemas: dict[str, dict[str, Any]] = {}

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content, completed calls) that ``delta`` settles."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content, calls) from what was held back, at the end of the output."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output as (content, calls)."""
        c1, t1 = self.feed(text)
        c2, t2 = self.finish()
        return c1 + c2, t1 + t2


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks anywhere in the output."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        content, calls = "", []
        while True:
            if not self._in_call:
                i = self._buf.find(self.OPEN)
                if i < 0:
                    settled, self._buf = split_held(self._buf, self.OPEN)
                    return content + settled, calls
                content += self._buf[:i]
                self._buf = self._buf[i + len(self.OPEN) :]
                self._in_call = True
            j = self._buf.find(self.CLOSE)
            if j < 0:
                return content, calls
            body, self._buf = self._buf[:j], self._buf[j + len(self.CLOSE) :]
            self._in_call = False
            call = self.decode(body)
            if call is None:
                content += self.OPEN + body + self.CLOSE
            else:
                calls.append(call)

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if not self._in_call:
            return rest, []
        self._in_call = False  # an unclosed call (the output was cut, or stopped at the tag)
        call = self.decode(rest)
        return ("", [call]) if call is not None else (self.OPEN + rest, [])

    def decode(self, body: str) -> ToolCall | None:
        """One call's text between the tags, or None if it does not parse."""
        return _decode_one(body)


class Qwen3XmlToolParser(HermesToolParser):
    """Qwen3-Coder's XML calls (vLLM's ``qwen3_xml``, alias ``qwen3_coder``): inside
    ``<tool_call>``, ``<function=NAME>`` and one ``<parameter=KEY>VALUE</parameter>`` per
    argument. Values are text, typed by the tool's schema (integer, number, boolean, object,
    array; a string stays as written, less the newline after the tag and before the end)."""

    name = "qwen3_xml"

    def decode(self, body: str) -> ToolCall | None:
        m = re.fullmatch(r"\s*<function=([^>\n]+)>(.*?)(?:</function>)?\s*", body, re.S)
        if m is None:
            return None
        name, inner = m.group(1).strip(), m.group(2)
        props = (self.schemas.get(name) or {}).get("properties") or {}
        args: dict[str, Any] = {}
        for key, raw in re.findall(r"<parameter=([^>\n]+)>(.*?)</parameter>", inner, re.S):
            text = raw[1:] if raw.startswith("\n") else raw
            text = text[:-1] if text.endswith("\n") else text
            args[key.strip()] = _typed(text, (props.get(key.strip()) or {}).get("type"))
        return ToolCall(name, json.dumps(args, ensure_ascii=False)) if name else None


def _typed(text: str, kind: Any) -> Any:
    """A parameter's text as its schema's type says (the text itself where it does not
    parse as that type, or the schema gives none and it is not JSON)."""
    if kind == "string":
        return text
    if kind == "boolean" and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind in ("integer", "number") and not isinstance(value, (int, float)):
        return text
    return value


def _decode_one(body: str) -> ToolCall | None:
    try:
        return _call_of(json.loads(body))
    except json.JSONDecodeError:
        return None


def _decode_many(text: str, args_keys: tuple[str, ...], sep: str = ";") -> list[ToolCall] | None:
    """Consecutive JSON objects separated by ``sep`` and whitespace (or a JSON list of them)
    as calls; None if any part is not a call."""
    dec = json.JSONDecoder()
    text = text.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(items, list) or not items:
            return None
        calls = [_call_of(x, args_keys) for x in items]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(text):
        try:
            obj, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        call = _call_of(obj, args_keys)
        if call is None:
            return None
        calls.append(call)
        pos = end
        while pos < len(text) and (text[pos].isspace() or text[pos] == sep):
            pos += 1
    return calls or None


class WholeOutputToolParser(ToolParser):
    """Formats where the whole output is the calls or it is all content, decided by how it
    opens (after whitespace): with ``TAG`` or ``OPENER`` it is held to the end (the arguments
    may hold anything) and ``calls_of`` reads it; anything else streams as content."""

    needs_special_tokens = True
    TAG = ""  # an optional special token before the calls
    OPENER = ""  # the calls' first character

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "deciding"  # -> "content" | "calls"

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        if self._mode == "deciding":
            head = self._buf.lstrip()
            if head.startswith((self.TAG, self.OPENER)):
                self._mode = "calls"
            elif not head or self.TAG.startswith(head):
                return "", []
            else:
                self._mode = "content"
        if self._mode == "calls":
            return "", []  # decided at the end
        out, self._buf = self._buf, ""
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if self._mode != "calls":
            return rest, []
        calls = self.calls_of(rest.strip().removeprefix(self.TAG))
        return ("", calls) if calls else (rest, [])

    def calls_of(self, body: str) -> list[ToolCall] | None:
        """The calls of the output after ``TAG`` (None: it is not calls after all)."""
        raise NotImplementedError


class Llama3JsonToolParser(WholeOutputToolParser):
    """The whole output is the calls (JSON objects, ``;``-separated), or it is all content."""

    name = "llama3_json"
    TAG, OPENER = "<|python_tag|>", "{"

    def calls_of(self, body: str) -> list[ToolCall] | None:
        return _decode_many(body, ("parameters", "arguments"))


class MistralToolParser(ToolParser):
    """Content, then ``[TOOL_CALLS]`` and the calls to the end of the output."""

    name = "mistral"
    needs_special_tokens = True
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self) -> None:
        self._buf = ""
        self._in_calls = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        if self._in_calls:
            return "", []
        i = self._buf.find(self.TAG)
        if i >= 0:
            content, self._buf = self._buf[:i], self._buf[i + len(self.TAG) :]
            self._in_calls = True
            return content, []
        content, self._buf = split_held(self._buf, self.TAG)
        return content, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if not self._in_calls:
            return rest, []
        calls = self._parse_calls(rest)
        if not calls:
            return self.TAG + rest, []
        for c in calls:
            c.id = mistral_tool_call_id()
        return "", calls

    def _parse_calls(self, body: str) -> list[ToolCall] | None:
        if self.ARGS not in body:  # up to v7: a JSON list (or objects)
            return _decode_many(body, ("arguments", "parameters"))
        calls = []  # v11+: name[ARGS]{...}, each call after its own [TOOL_CALLS]
        for part in body.split(self.TAG):
            name, sep, args = part.partition(self.ARGS)
            if not sep:
                return None
            call = _call_of({"name": name.strip(), "arguments": args.strip()})
            if call is None:
                return None
            calls.append(call)
        return calls


class PythonicToolParser(WholeOutputToolParser):
    """Llama 3.2 / Llama 4's pythonic calls (vLLM's ``pythonic``): the whole output is a Python
    list of calls with literal keyword arguments, ``[get_weather(city="Paris"), now()]``
    (optionally between ``<|python_start|>`` and ``<|python_end|>``); anything else is all
    content. The list is read with ``ast`` (literals only: nothing is evaluated)."""

    name = "pythonic"
    TAG, OPENER = "<|python_start|>", "["

    def calls_of(self, body: str) -> list[ToolCall] | None:
        for tag in (self.TAG, "<|python_end|>"):
            body = body.replace(tag, "")
        return _pythonic_calls(body.strip())


def _pythonic_calls(text: str) -> list[ToolCall] | None:
    """``[f(a=1), g(b="x")]`` as calls; None if it is anything else (positional arguments,
    non-literal values, not a list of calls)."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            return None
        if None in args:  # **kwargs
            return None
        calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


def _string_end(t: str, i: int) -> int | None:
    """Index after the JSON string starting at ``t[i]`` (a quote), None if it is not closed."""
    j = i + 1
    while j < len(t):
        if t[j] == "\\":
            j += 2
            continue
        if t[j] == '"':
            return j + 1
        j += 1
    return None


def _value_end(t: str, i: int) -> int | None:
    """Index after the JSON value starting at ``t[i]``, None if the text ends inside it (a
    number or literal at the very end counts as unfinished: more digits may come)."""
    if t[i] == '"':
        return _string_end(t, i)
    if t[i] in "{[":
        depth, j = 0, i
        while j < len(t):
            c = t[j]
            if c == '"':
                end = _string_end(t, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(t) and t[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(t) else None


class RequiredListStream:
    """The calls of a ``tool_choice="required"`` output - a JSON list of ``{"name": ...,
    "parameters": {...}}`` - streamed: a call opens once its name is read, then its
    arguments (the raw JSON text of ``parameters``) follow as the model writes them.

    Example: after ``[{"name": "f", "parameters": {"x": 1`` call 0 is open with arguments
    ``{"x": 1`` sent so far; ``}}, {"na`` completes them (``{"x": 1}``) and opens nothing yet.
    The text is scanned again from the start at each delta (outputs are short)."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[ToolCall] = []
        self._sent: list[int] = []  # characters of each call's arguments sent

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The OpenAI stream deltas (``tool_calls`` entries) that ``delta`` adds."""
        self.text += delta
        out: list[dict[str, Any]] = []
        for k, (name, args) in enumerate(self._scan()):
            if name is None:
                break  # calls open in order: a later one waits for this one's name
            if k == len(self.calls):
                self.calls.append(ToolCall(name, ""))
                self._sent.append(0)
                out.append({"index": k, "id": self.calls[k].id, "type": "function",
                            "function": {"name": name, "arguments": ""}})  # fmt: skip
            new = args[self._sent[k] :]
            if new:
                self.calls[k].arguments += new
                self._sent[k] = len(args)
                if out and out[-1]["index"] == k:
                    out[-1]["function"]["arguments"] += new
                else:
                    out.append({"index": k, "function": {"arguments": new}})
        return out

    def _scan(self) -> list[tuple[str | None, str]]:
        """(name if read, arguments text so far) of each item begun."""
        t, items = self.text, []
        i = t.find("[")
        if i < 0:
            return items
        i += 1
        while True:
            while i < len(t) and (t[i].isspace() or t[i] == ","):
                i += 1
            if i >= len(t) or t[i] != "{":
                return items
            i += 1
            name: str | None = None
            args = ""
            items.append((name, args))
            while True:
                while i < len(t) and (t[i].isspace() or t[i] == ","):
                    i += 1
                if i >= len(t):
                    return items
                if t[i] == "}":
                    i += 1
                    break
                key_end = _string_end(t, i) if t[i] == '"' else None
                if key_end is None:
                    return items
                key = t[i + 1 : key_end - 1]
                i = key_end
                while i < len(t) and (t[i].isspace() or t[i] == ":"):
                    i += 1
                if i >= len(t):
                    return items
                end = _value_end(t, i)
                if key == "parameters":
                    args = t[i:end] if end is not None else t[i:]
                elif key == "name" and end is not None:
                    try:
                        value = json.loads(t[i:end])
                    except json.JSONDecodeError:
                        value = None
                    name = value if isinstance(value, str) else None
                items[-1] = (name, args)
                if end is None:
                    return items
                i = end


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser,
              Qwen3XmlToolParser)  # fmt: skip
}
TOOL_PARSERS["qwen3_coder"] = Qwen3XmlToolParser  # vLLM's other name for it


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class of ``--tool-call-parser name``; ValueError naming the choices."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"--tool-call-parser: unknown parser {name!r}; choose one of "
            f"{', '.join(sorted(TOOL_PARSERS))}."
        ) from None
