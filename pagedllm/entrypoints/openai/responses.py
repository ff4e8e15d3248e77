"""``/v1/responses`` (OpenAI's Responses API) for text, on top of chat completions.

A request becomes a chat conversation: ``instructions`` as the system message, then the
conversation of ``previous_response_id`` (its input and output, without its instructions, as
OpenAI does), then ``input`` (a string: one user message; or items: messages with text
content, ``function_call`` items the model made and ``function_call_output`` items that answer
them). Tools use the Responses shape (``{"type": "function", "name", "parameters"}``) and
``tool_choice`` the same modes as chat (``{"type": "function", "name": ...}`` for a named
one); ``text.format`` asks for JSON (``json_schema`` or ``json_object``). The chat machinery
renders, runs and shapes the output (``tools.ChoiceShaper``), which becomes output items:
``reasoning`` (with ``--reasoning-parser``), ``message`` and ``function_call``.

Stored responses (``store``, default true) are kept in this process's memory for
``STORE_TTL_S`` seconds, at most ``STORE_MAX`` of them (oldest dropped first), for
``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``. With several API server
processes each keeps its own: a follow-up may reach one that does not know the id (404).

Streaming sends OpenAI's typed events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
``response.completed`` or ``response.incomplete``), each with a ``sequence_number``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field, ValidationError

from pagedllm.engine.async_llm import EngineDeadError, EngineError
from pagedllm.entrypoints.openai.chat import ServingChat
from pagedllm.entrypoints.openai.errors import RequestError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIBaseModel
from pagedllm.entrypoints.openai.serving import (
    Collected,
    SSEStream,
    Started,
    engine_error,
    internal_error,
    off_loop,
    usage_dict,
)
from pagedllm.entrypoints.openai.tools import ChoiceShaper, Shaped


def random_id(prefix: str) -> str:
    """An id in OpenAI's Responses form, e.g. ``resp_3f2a...``, ``msg_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


STORE_TTL_S = 3600.0
STORE_MAX = 4096

# chat's field names in errors, as this API names them
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text"}


class ResponsesRequest(OpenAIBaseModel):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None
    background: bool = False
    # vLLM extras
    seed: int | None = None
    top_k: int | None = None
    priority: int = 0
    cache_salt: str | None = None


class ResponseStore:
    """Finished responses by id, with the chat conversation each one ends: bounded in time
    (``ttl`` seconds) and number (``max_items``, oldest dropped first)."""

    def __init__(self, ttl: float = STORE_TTL_S, max_items: int = STORE_MAX) -> None:
        self.ttl, self.max_items = ttl, max_items
        self._items: OrderedDict[str, tuple[float, dict[str, Any], list[dict[str, Any]]]] = (
            OrderedDict()
        )

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._expire()
        self._items[response["id"]] = (time.monotonic() + self.ttl, response, conversation)
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(response, conversation); 404 (OpenAI's message) if unknown or expired."""
        self._expire()
        item = self._items.get(rid)
        if item is None:
            raise RequestError(f"Response with id '{rid}' not found.", param="response_id",
                               status_code=404, err_type="NotFoundError")  # fmt: skip
        return item[1], item[2]

    def delete(self, rid: str) -> None:
        self.get(rid)
        del self._items[rid]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._items:
            rid, (deadline, _, _) = next(iter(self._items.items()))
            if deadline > now:
                return
            del self._items[rid]


def _text_of(content: Any, where: str) -> str:
    """The text of a message's content: a string, or parts of type input_text / output_text /
    text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of parts.", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(
            part.get("text"), str
        ):
            raise RequestError(f"{where}: only text content parts are supported, got {kind!r}.",
                               param="input")  # fmt: skip
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages (400 naming ``input`` for an item it cannot take).
    Consecutive function_call items become one assistant message with several tool calls."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise RequestError("input must not be empty.", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object.", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role must be user, assistant, system or developer.",
                                   param="input")  # fmt: skip
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content"), where)})  # fmt: skip
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "{}")
            call_id = item.get("call_id")
            if not isinstance(name, str) or not isinstance(args, str) or not call_id:
                raise RequestError(f"{where}: a function_call needs call_id, name and arguments.",
                                   param="input")  # fmt: skip
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not item.get("call_id") or not isinstance(output, str):
                raise RequestError(f"{where}: a function_call_output needs call_id and output.",
                                   param="input")  # fmt: skip
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # the model's earlier thinking: templates drop it from the history
        else:
            raise RequestError(f"{where}: input items of type {kind!r} are not supported.",
                               param="input")  # fmt: skip
    return out


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise RequestError(f"tools[{i}]: only function tools are supported, got {kind!r}.",
                               param="tools")  # fmt: skip
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise RequestError("text.format must be an object.", param="text")
    if fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name", "output"), "schema": fmt.get("schema")}
        return {"type": "json_schema", "json_schema": schema}
    return fmt


class ServingResponses:
    """The Responses API on top of a ``ServingChat``."""

    def __init__(self, chat: ServingChat, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    def to_chat(self, req: ResponsesRequest) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """(the chat request, the conversation without instructions) of a Responses request."""
        if req.background:
            raise RequestError("background responses are not supported.", param="background")
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            try:
                history = list(self.store.get(req.previous_response_id)[1])
            except RequestError as e:
                e.param = "previous_response_id"
                raise
        conversation = history + input_messages(req.input)
        messages = conversation
        if req.instructions:
            messages = [{"role": "system", "content": req.instructions}, *conversation]
        body: dict[str, Any] = {
            "model": req.model,
            "messages": messages,
            "max_completion_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": _chat_tools(req.tools),
            "tool_choice": _chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": _response_format(req.text),
            "seed": req.seed,
            "top_k": req.top_k,
            "priority": req.priority,
            "cache_salt": req.cache_salt,
            "stream": req.stream,
        }
        try:
            creq = ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None}
            )
        except ValidationError as e:
            err = e.errors()[0]
            field = str(err["loc"][0]) if err.get("loc") else None
            raise RequestError(f"{field}: {err['msg']}",
                               param=_PARAMS.get(field or "", field)) from e  # fmt: skip
        return creq, conversation

    async def create(self, req: ResponsesRequest) -> dict[str, Any] | SSEStream:
        """The response object or, when streaming, its SSE events."""
        try:
            creq, conversation = self.to_chat(req)
            p = await off_loop(self.chat.prepare, creq)
            await self.chat.check_structured(p.params, creq.structured_field)
            rid = random_id("resp")
            started = await self.chat.start([(p.text, p.ids)], p.params, rid, creq.priority,
                                            creq.cache_salt, lora_request=p.lora)  # fmt: skip
        except RequestError as e:
            e.param = _PARAMS.get(e.param or "", e.param)
            raise
        shaper = self.chat.shaper(p.mode, p.text) or ChoiceShaper(p.mode, None, None, p.text)
        base = self._base(req, rid)
        if req.stream:
            return SSEStream(self._events(req, base, started[0], shaper, conversation), started)
        (result,) = await self.chat.collect(started)
        choice = result.ordered(1)[0]
        shaper.feed(choice.text)
        shaper.finish()
        response = self._finish(base, shaper, choice.finish_reason,
                                self._usage(result, len(choice.token_ids)))  # fmt: skip
        self._keep(req, response, conversation, shaper)
        return response

    # ------------------------------------------------------------------------ the object
    def _base(self, req: ResponsesRequest, rid: str) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.chat.reply_model(req.model),
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning or {"effort": None, "summary": None},
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    @staticmethod
    def _usage(result: Collected, output_tokens: int) -> dict[str, Any]:
        u = usage_dict(len(result.prompt_token_ids), output_tokens, result.num_cached_tokens)
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": result.num_cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        }

    @staticmethod
    def _items(shaper: ChoiceShaper, ids: dict[str, str]) -> list[dict[str, Any]]:
        """The output items of a finished choice (ids given by the stream, else new)."""
        items: list[dict[str, Any]] = []
        if shaper.reasoning_text is not None:
            items.append(_reasoning_item(ids.get("reasoning") or random_id("rs"),
                                         shaper.reasoning_text))  # fmt: skip
        if shaper.content:
            items.append(_message_item(ids.get("message") or random_id("msg"), shaper.content))
        for i, call in enumerate(shaper.calls):
            items.append(_call_item(ids.get(f"call{i}") or random_id("fc"), call.id, call.name,
                                    call.arguments))  # fmt: skip
        return items

    def _finish(
        self,
        base: dict[str, Any],
        shaper: ChoiceShaper,
        reason: str | None,
        usage: dict[str, Any],
        ids: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        out = dict(base)
        out["output"] = self._items(shaper, ids or {})
        out["usage"] = usage
        if reason == "length":
            out["status"] = "incomplete"
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            out["status"] = "completed"
        return out

    def _keep(self, req: ResponsesRequest, response: dict[str, Any],
              conversation: list[dict[str, Any]], shaper: ChoiceShaper) -> None:  # fmt: skip
        if not req.store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": shaper.content or None}
        if shaper.calls:
            reply["tool_calls"] = [c.to_openai() for c in shaper.calls]
        self.store.put(response, [*conversation, reply])

    # ------------------------------------------------------------------------ streaming
    async def _events(
        self,
        req: ResponsesRequest,
        base: dict[str, Any],
        started: Started,
        shaper: ChoiceShaper,
        conversation: list[dict[str, Any]],
    ) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            body = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

        writer = _ItemWriter(event)
        yield event("response.created", response=base)
        yield event("response.in_progress", response=base)
        result = Collected(started.prompt_text, started.prompt_token_ids)
        tokens = 0
        try:
            async for out in started.stream:
                result.add(out)
                for c in out.outputs:
                    tokens += len(c.token_ids)
                    shaped = shaper.step(c.text, c.finish_reason is not None)
                    for e in writer.write(shaped):
                        yield e
                if out.error is not None:
                    err = engine_error(out.error)
                    yield event("error", code=str(err.status_code), message=err.message,
                                param=err.param)  # fmt: skip
                    return
            for e in writer.close():
                yield e
            choice = result.ordered(1)[0] if result.choices else None
            reason = choice.finish_reason if choice else None
            final = self._finish(base, shaper, reason, self._usage(result, tokens), writer.ids)
            self._keep(req, final, conversation, shaper)
            kind = "response.incomplete" if final["status"] == "incomplete" else \
                "response.completed"  # fmt: skip
            yield event(kind, response=final)
        except (EngineError, EngineDeadError) as e:
            err = internal_error(e)
            yield event("error", code=str(err.status_code), message=err.message, param=None)
        finally:
            started.stream.abort()


def _reasoning_item(iid: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": iid, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _message_item(iid: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if text or \
        status == "completed" else []  # fmt: skip
    return {"type": "message", "id": iid, "status": status, "role": "assistant",
            "content": content}  # fmt: skip


def _call_item(iid: str, call_id: str, name: str, arguments: str,
               status: str = "completed") -> dict[str, Any]:  # fmt: skip
    return {"type": "function_call", "id": iid, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


class _ItemWriter:
    """Turns shaped deltas into the events of output items, one item open at a time:
    reasoning text, then message text, then function calls (each opened, its arguments, done).
    ``ids`` remembers the item ids for the final response."""

    def __init__(self, event: Any) -> None:
        self.event = event
        self.index = -1  # output_index of the open (or last) item
        self.open: str | None = None  # "reasoning" | "message" | "call" | None
        self.call: tuple[str, str, str] = ("", "", "")  # the open call: item id, call id, name
        self.text = ""
        self.ids: dict[str, str] = {}
        self._calls = 0

    def write(self, shaped: Shaped) -> list[str]:
        ev: list[str] = []
        if shaped.reasoning:
            ev += self._open("reasoning", "rs")
            ev.append(self.event("response.reasoning_text.delta", item_id=self.ids["reasoning"],
                                 output_index=self.index, content_index=0,
                                 delta=shaped.reasoning))  # fmt: skip
            self.text += shaped.reasoning
        if shaped.content:
            ev += self._open("message", "msg")
            ev.append(self.event("response.output_text.delta", item_id=self.ids["message"],
                                 output_index=self.index, content_index=0,
                                 delta=shaped.content, logprobs=[]))  # fmt: skip
            self.text += shaped.content
        for tc in shaped.tool_calls:
            fn = tc["function"]
            if "id" in tc:  # a new call
                ev += self.close()
                self.index += 1
                self.open = "call"
                self.ids[f"call{self._calls}"] = iid = random_id("fc")
                self._calls += 1
                self.call = (iid, tc["id"], fn["name"])
                self.text = ""
                ev.append(self.event("response.output_item.added", output_index=self.index,
                                     item=_call_item(iid, tc["id"], fn["name"], "",
                                                     "in_progress")))  # fmt: skip
            if fn.get("arguments"):
                self.text += fn["arguments"]
                ev.append(self.event("response.function_call_arguments.delta",
                                     item_id=self.call[0], output_index=self.index,
                                     delta=fn["arguments"]))  # fmt: skip
        return ev

    def _open(self, kind: str, prefix: str) -> list[str]:
        if self.open == kind:
            return []
        ev = self.close()
        self.index += 1
        self.open = kind
        self.ids[kind] = iid = random_id(prefix)
        self.text = ""
        if kind == "reasoning":
            item = {"type": "reasoning", "id": iid, "summary": [], "content": [],
                    "status": "in_progress"}  # fmt: skip
            return ev + [self.event("response.output_item.added", output_index=self.index,
                                    item=item)]  # fmt: skip
        part = {"type": "output_text", "text": "", "annotations": []}
        return ev + [
            self.event("response.output_item.added", output_index=self.index,
                       item=_message_item(iid, "", "in_progress")),
            self.event("response.content_part.added", item_id=iid, output_index=self.index,
                       content_index=0, part=part),
        ]  # fmt: skip

    def close(self) -> list[str]:
        """Events that end the open item (if any)."""
        ev: list[str] = []
        if self.open == "reasoning":
            iid = self.ids["reasoning"]
            ev.append(self.event("response.reasoning_text.done", item_id=iid,
                                 output_index=self.index, content_index=0, text=self.text))
            ev.append(self.event("response.output_item.done", output_index=self.index,
                                 item=_reasoning_item(iid, self.text)))  # fmt: skip
        elif self.open == "message":
            iid = self.ids["message"]
            part = {"type": "output_text", "text": self.text, "annotations": []}
            ev.append(self.event("response.output_text.done", item_id=iid,
                                 output_index=self.index, content_index=0, text=self.text,
                                 logprobs=[]))  # fmt: skip
            ev.append(self.event("response.content_part.done", item_id=iid,
                                 output_index=self.index, content_index=0, part=part))
            ev.append(self.event("response.output_item.done", output_index=self.index,
                                 item=_message_item(iid, self.text)))  # fmt: skip
        elif self.open == "call":
            iid, call_id, name = self.call
            ev.append(self.event("response.function_call_arguments.done", item_id=iid,
                                 output_index=self.index, name=name, arguments=self.text))
            ev.append(self.event("response.output_item.done", output_index=self.index,
                                 item=_call_item(iid, call_id, name, self.text)))  # fmt: skip
        self.open = None
        return ev
