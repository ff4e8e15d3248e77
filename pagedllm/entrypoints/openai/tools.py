"""Tool calling and reasoning in chat completions: what a request's ``tools`` and
``tool_choice`` ask for, the grammar that makes ``required`` and named calls parse, and the
shaping of each choice's text into ``reasoning_content``, ``content`` and ``tool_calls``.

``tool_choice`` (OpenAI's default: ``auto`` when tools are given, else ``none``):

- ``none``: the model answers in text; the tools still reach the chat template (vLLM).
- ``auto``: the model decides; the server's ``--tool-call-parser`` finds the calls it writes
  in its own format. Needs ``--enable-auto-tool-choice`` (400 otherwise, as vLLM).
- ``required``: at least one call. The output is constrained to a JSON list of
  ``{"name": <a tool's name>, "parameters": <its schema>}`` (at most one item with
  ``parallel_tool_calls: false``), so every call parses and matches its schema; the model's
  own format is not used (vLLM's method). finish_reason ``tool_calls``.
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's
  parameters schema and becomes that call's arguments. finish_reason ``stop`` (as vLLM and
  OpenAI).

With ``--reasoning-parser`` the model's thinking comes first (``reasoning_content``) and the
constraints above, like any structured output, apply to the answer after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.reasoning import ReasoningFormat, ReasoningSplitter
from pagedllm.entrypoints.openai.request_error import RequestError
from pagedllm.entrypoints.openai.tool_parsers import RequiredListStream, ToolCall, ToolParser


@dataclass(frozen=True)
class FunctionTool:
    """One tool of a request: a function with a JSON schema for its arguments."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None

    def to_openai(self) -> dict[str, Any]:
        """The tool as chat templates receive it (OpenAI's chat-completions shape)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def parse_tools(tools: list[dict[str, Any]] | None, flat: bool = False) -> list[FunctionTool]:
    """The request's tools, checked; 400 naming ``tools`` if one is malformed. ``flat``: the
    Responses API's shape (``{"type": "function", "name", "parameters"}``) instead of chat's
    (``{"type": "function", "function": {...}}``)."""
    out: list[FunctionTool] = []
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestError(f"{where}: only tools of type 'function' are supported.",
                               param="tools")  # fmt: skip
        fn = tool if flat else tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{where}.function must be an object.", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}: the function needs a non-empty name.", param="tools")
        if name in names:
            raise RequestError(f"{where}: two tools are named {name!r}.", param="tools")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise RequestError(f"{where}: parameters must be a JSON schema object.",
                               param="tools")  # fmt: skip
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise RequestError(f"{where}: description must be a string.", param="tools")
        out.append(FunctionTool(name, desc, params))
    return out


@dataclass(frozen=True)
class ToolMode:
    """What a request's tool_choice resolved to: ``kind`` none | auto | required | named."""

    kind: str
    tools: tuple[FunctionTool, ...] = ()
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.kind in ("required", "named")

    def schema(self) -> dict[str, Any]:
        """The JSON schema the output must match (required / named)."""
        if self.kind == "named":
            tool = next(t for t in self.tools if t.name == self.name)
            return tool.parameters or {"type": "object"}
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.name]},
                    "parameters": t.parameters or {"type": "object"},
                },
                "required": ["name", "parameters"],
            }
            for t in self.tools
        ]
        item = items[0] if len(items) == 1 else {"anyOf": items}
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


def resolve_tool_choice(
    tools: list[FunctionTool],
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    auto_enabled: bool,
) -> ToolMode:
    """The request's ToolMode; 400 naming ``tool_choice`` where it cannot be honoured."""
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") if "function" in tool_choice else tool_choice
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError(
                "tool_choice must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}.',
                param="tool_choice",
            )
        if name not in {t.name for t in tools}:
            raise RequestError(f"tool_choice names the function {name!r}, which is not in tools.",
                               param="tool_choice")  # fmt: skip
        return ToolMode("named", tuple(tools), name, parallel)
    if tool_choice not in ("none", "auto", "required"):
        raise RequestError(
            f"tool_choice must be 'none', 'auto', 'required' or a function; got {tool_choice!r}.",
            param="tool_choice",
        )
    if tool_choice != "none" and not tools:
        raise RequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if tool_choice == "auto" and not auto_enabled:
        raise RequestError(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            "be set.",
            param="tool_choice",
        )
    return ToolMode(tool_choice, tuple(tools), None, parallel)


@dataclass
class Shaped:
    """What one delta (or a whole output) of a choice adds to the reply."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # stream-delta form


class ChoiceShaper:
    """Splits one choice's text, delta by delta, into reasoning, content and tool calls.

    Streamed tool calls use OpenAI's delta form: a call opens with ``{"index", "id", "type",
    "function": {"name", "arguments"}}`` and later deltas of the same index add to its
    ``arguments`` (named and required calls stream their arguments as they come; a call the
    parser finds in the model's own format arrives whole)."""

    def __init__(
        self,
        mode: ToolMode,
        parser: ToolParser | None,
        reasoning: ReasoningFormat | None,
        prompt_text: str | None,
    ) -> None:
        self.mode = mode
        self.parser = parser if mode.kind == "auto" else None
        self.splitter = ReasoningSplitter(reasoning, prompt_text) if reasoning else None
        self.calls: list[ToolCall] = []
        self.reasoning_text: str | None = None  # None: the output had no thinking part
        self.content = ""
        self._named: ToolCall | None = None
        self._required = RequiredListStream() if mode.kind == "required" else None

    def feed(self, delta: str) -> Shaped:
        if self.splitter is None:
            return self._answer(delta, False)
        reasoning, answer = self.splitter.feed(delta)
        out = self._answer(answer, False)
        out.reasoning = reasoning
        self._add_reasoning(reasoning)
        return out

    def step(self, text: str, finished: bool) -> Shaped:
        """One streamed delta of the choice: its text fed, and the rest when it ``finished``."""
        out = self.feed(text) if text else Shaped()
        if finished:
            end = self.finish()
            out.reasoning += end.reasoning
            out.content += end.content
            out.tool_calls += end.tool_calls
        return out

    def finish(self) -> Shaped:
        """The rest, at the end of the output."""
        reasoning = ""
        answer = ""
        if self.splitter is not None:
            reasoning, answer = self.splitter.finish()
            self._add_reasoning(reasoning)
        out = self._answer(answer, True)
        out.reasoning = reasoning
        return out

    def _add_reasoning(self, text: str) -> None:
        if self.splitter is not None and self.splitter.thought:
            self.reasoning_text = (self.reasoning_text or "") + text

    def _answer(self, text: str, final: bool) -> Shaped:
        out = Shaped()
        kind = self.mode.kind
        if kind == "named":
            if self._named is None and (text or final):
                self._named = ToolCall(self.mode.name or "", "")
                self.calls.append(self._named)
                out.tool_calls.append(self._open(0, self._named))
            if text and self._named is not None:
                self._named.arguments += text
                if out.tool_calls:
                    out.tool_calls[0]["function"]["arguments"] = text
                else:
                    out.tool_calls.append({"index": 0, "function": {"arguments": text}})
            return out
        if kind == "required":
            assert self._required is not None
            deltas = self._required.feed(text)
            if final and not self._required.calls:  # cut before a call opened: keep the text
                out.content = self._required.text
                self.content += out.content
                return out
            self.calls = list(self._required.calls)
            out.tool_calls += deltas
            return out
        if self.parser is not None:
            content, calls = self.parser.feed(text)
            if final:
                c2, t2 = self.parser.finish()
                content, calls = content + c2, calls + t2
            out.content = content
            self.content += content
            self._add_calls(calls, out)
            return out
        out.content = text
        self.content += text
        return out

    def _add_calls(self, calls: list[ToolCall], out: Shaped) -> None:
        for call in calls:
            out.tool_calls.append(self._open(len(self.calls), call, call.arguments))
            self.calls.append(call)

    @staticmethod
    def _open(index: int, call: ToolCall, arguments: str = "") -> dict[str, Any]:
        return {
            "index": index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": arguments},
        }

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` where the model's own calls were found (auto), or the required list
        closed (stop); a named call keeps the engine's reason, as vLLM and OpenAI do."""
        if self.calls and (
            self.mode.kind == "auto" or self.mode.kind == "required" and engine_reason == "stop"
        ):
            return "tool_calls"
        return engine_reason

    def message(self, role: str, echo: str = "", include_reasoning: bool = True
                ) -> dict[str, Any]:  # fmt: skip
        """The whole reply's ``message`` (after ``feed``/``finish`` saw all the text)."""
        content: str | None = echo + self.content
        if self.calls and not content:
            content = None
        msg: dict[str, Any] = {"role": role, "content": content}
        if self.splitter is not None and include_reasoning:
            msg["reasoning_content"] = self.reasoning_text
        if self.calls:
            msg["tool_calls"] = [c.to_openai() for c in self.calls]
        return msg

