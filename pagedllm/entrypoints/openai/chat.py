"""``POST /v1/chat/completions``: render the chat template, generate, answer in OpenAI's format.

The template comes from (first found): the request's ``chat_template`` (a vLLM extra), the
server's ``--chat-template`` (a file path or an inline Jinja string), the tokenizer's own (HF
``tokenizer_config.json`` or the GGUF's ``tokenizer.chat_template`` metadata).

``n`` > 1 answers n choices (each streamed with its ``index``, each opened by its own role
chunk); ``use_beam_search`` answers the n best hypotheses of a width-n beam search
(non-streaming only); structured outputs and ``cache_salt`` work as in completions.

Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``; ``tool`` messages and assistant
``tool_calls`` in the history) and reasoning output (``reasoning_content``) are shaped per
choice by ``tools.ChoiceShaper``; the server's ``--enable-auto-tool-choice``,
``--tool-call-parser`` and ``--reasoning-parser`` choose the formats (see ``tools.py``).
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, NamedTuple

from pagedllm.engine.async_llm import AsyncLLMBase
from pagedllm.entrypoints.openai.errors import RequestError
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, now, random_id
from pagedllm.entrypoints.openai.reasoning import (
    ReasoningSplitter,
    get_reasoning_format,
    reasoning_token_ids,
)
from pagedllm.entrypoints.openai.serving import (
    Choice,
    Collected,
    ServingBase,
    SSEStream,
    Started,
    clamp_logprob,
    off_loop,
    transfer_field,
)
from pagedllm.entrypoints.openai.tool_parsers import get_tool_parser
from pagedllm.entrypoints.openai.tools import (
    ChoiceShaper,
    ToolMode,
    parse_tools,
    resolve_tool_choice,
)
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.params import StructuredOutputsParams

# Keyword arguments of apply_chat_template that chat_template_kwargs may not override.
_RESERVED_TEMPLATE_KWARGS = {
    "conversation", "tokenize", "chat_template", "add_generation_prompt",
    "continue_final_message", "return_dict", "return_tensors", "padding", "truncation",
}  # fmt: skip


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: the contents of a file if ``value`` is a path, else ``value``."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template.")
    return value


class Prepared(NamedTuple):
    """A chat request checked and rendered: its prompt, sampling params, resolved tool choice
    and LoRA adapter (None: the base model)."""

    text: str
    ids: list[int]
    params: SamplingParams
    mode: ToolMode
    lora: LoRARequest | None


class ServingChat(ServingBase):
    """Chat completions on top of ``ServingBase``. ``tool_call_parser`` and
    ``reasoning_parser`` are the server's flags (names; ValueError for an unknown one, or a
    reasoning format the tokenizer cannot spell in one token)."""

    def __init__(
        self,
        llm: AsyncLLMBase,
        model_name: str,
        chat_template: str | None = None,
        longest_token: concurrent.futures.Future[int] | None = None,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        exclude_tools_when_tool_choice_none: bool = False,
    ) -> None:
        super().__init__(llm, model_name, longest_token)
        self.chat_template = chat_template
        self.exclude_tools_when_none = exclude_tools_when_tool_choice_none
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser.")
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.enable_auto_tools = enable_auto_tool_choice
        self.reasoning = get_reasoning_format(reasoning_parser) if reasoning_parser else None
        self.reasoning_ids = (
            reasoning_token_ids(self.reasoning, self.tokenizer) if self.reasoning else None
        )

    def tool_mode(self, req: ChatCompletionRequest) -> ToolMode:
        """The request's tools and tool_choice, checked (400 naming the field)."""
        return resolve_tool_choice(parse_tools(req.tools), req.tool_choice,
                                   req.parallel_tool_calls, self.enable_auto_tools)  # fmt: skip

    def shaper(self, mode: ToolMode, prompt_text: str | None) -> ChoiceShaper | None:
        """A choice's shaper, or None where its text goes out as it comes (no tools in play,
        no reasoning parser)."""
        if mode.kind == "none" and self.reasoning is None:
            return None
        parser = self.tool_parser() if self.tool_parser is not None else None
        if parser is not None:
            parser.schemas = {t.name: t.parameters or {} for t in mode.tools}
        return ChoiceShaper(mode, parser, self.reasoning, prompt_text)

    def render(self, req: ChatCompletionRequest, mode: ToolMode) -> tuple[str, list[int]]:
        """(prompt text, token ids) of the conversation under the chat template, which gets
        the request's tools (``mode``: its resolved tool_choice)."""
        template = req.chat_template or self.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                "this model has no chat template; start the server with --chat-template, or "
                "use /v1/completions.",
                param="messages",
            )
        self.check_text_fits(sum(len(m.text()) for m in req.messages), "messages")
        kwargs = {
            k: v
            for k, v in (req.chat_template_kwargs or {}).items()
            if k not in _RESERVED_TEMPLATE_KWARGS
        }
        if mode.tools and not (self.exclude_tools_when_none and mode.kind == "none"):
            kwargs["tools"] = [t.to_openai() for t in mode.tools]
        try:
            text = self.tokenizer.apply_chat_template(
                req.conversation(),
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=template,
                **kwargs,
            )
        except RequestError:
            raise
        except Exception as e:  # jinja errors, raise_exception() in templates, bad kwargs
            raise RequestError(f"cannot apply the chat template: {e}", param="messages") from e
        if not isinstance(text, str):
            raise RequestError("the chat template did not render to text.", param="messages")
        ids = list(self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens))
        return text, ids

    def prepare(self, req: ChatCompletionRequest) -> Prepared:
        """Check, render and tokenize (on the tokenizer thread)."""
        lora = self.check_model(req.model)
        mode = self.tool_mode(req)
        params = req.to_sampling_params()
        self.check_num_seqs(req.n, "n")
        text, ids = self._render_checked(req, mode, req.max_new_tokens())
        if mode.constrained:
            if params.structured_outputs is not None:
                raise RequestError(
                    f"{req.structured_field} can not be combined with tool_choice "
                    f"{mode.kind!r} (the tool call is the structured output).",
                    param="tool_choice",
                )
            params.structured_outputs = StructuredOutputsParams(json=mode.schema())
            req.set_structured_field("tools")
        elif mode.kind == "auto" and self.tool_parser and self.tool_parser.needs_special_tokens:
            params.skip_special_tokens = False  # the parser reads its special-token markers
        so = params.structured_outputs
        if so is not None and self.reasoning_ids is not None:
            state = ReasoningSplitter(self.reasoning, text).state
            if state != "answer":  # the grammar waits for the thinking to end
                so.reasoning_end_token_id = self.reasoning_ids[1]
            if state == "opening":  # ... if the output opens one
                so.reasoning_start_token_id = self.reasoning_ids[0]
        try:
            self.llm.validate({"prompt": text, "prompt_token_ids": ids}, params)
        except ValueError as e:
            raise RequestError(str(e), param="messages") from e
        return Prepared(text, ids, params, mode, lora)

    def _render_checked(self, req: ChatCompletionRequest, mode: ToolMode,
                        max_tokens: int | None) -> tuple[str, list[int]]:  # fmt: skip
        text, ids = self.render(req, mode)
        if not ids:
            raise RequestError("the rendered conversation has no tokens.", param="messages")
        self.check_length(len(ids), max_tokens, "messages")
        return text, ids

    def _role(self, req: ChatCompletionRequest) -> str:
        return "assistant" if req.add_generation_prompt else req.messages[-1].role

    def _echo_text(self, req: ChatCompletionRequest) -> str:
        """vLLM's chat echo: the last message's content if its role is the reply's role."""
        if not req.echo:
            return ""
        last = req.messages[-1]
        return last.text() if last.role == self._role(req) else ""

    async def create(self, req: ChatCompletionRequest) -> dict[str, Any] | SSEStream:
        """The response body (dict) or, when streaming, an SSE text iterator."""
        if req.use_beam_search:
            return await self._beam_search(req)
        p = await off_loop(self.prepare, req)
        await self.check_structured(p.params, req.structured_field)
        rid = random_id("chatcmpl")
        started = await self.start([(p.text, p.ids)], p.params, rid, req.priority,
                                   req.cache_salt, req.n, lora_request=p.lora)  # fmt: skip
        created = now()
        if req.stream:
            return self._stream(req, started, rid, created, p.mode)
        return self._response(req, await self.collect(started), rid, created, p.mode)

    async def _beam_search(self, req: ChatCompletionRequest) -> dict[str, Any]:
        lora = self.check_model(req.model)
        mode = self.tool_mode(req)
        if mode.kind != "none":
            raise RequestError("tool calls are not supported with use_beam_search.",
                               param="tool_choice")  # fmt: skip
        req.to_beam_search_params(1)  # checks the fields before the template is rendered
        self.check_num_seqs(req.n, "n")
        text, ids = await off_loop(self._render_checked, req, mode, req.max_new_tokens())
        params = req.to_beam_search_params(self.max_model_len - len(ids))
        rid = random_id("chatcmpl")
        started = await self.start([(text, ids)], params, rid, n=req.n, lora_request=lora)
        return self._response(req, await self.collect(started), rid, now(), mode)

    def _response(
        self,
        req: ChatCompletionRequest,
        results: list[Collected],
        rid: str,
        created: int,
        mode: ToolMode,
    ) -> dict[str, Any]:
        (r,) = results
        choices = []
        for c in r.ordered(req.n):
            logprobs = None
            if req.logprobs:
                logprobs = {"content": self._logprobs(c, req.top_logprobs or 0)}
            shaper = self.shaper(mode, r.prompt_text)
            finish_reason = c.finish_reason
            if shaper is None:
                message = {"role": self._role(req), "content": self._echo_text(req) + c.text}
            else:
                shaper.feed(c.text)
                shaper.finish()
                message = shaper.message(self._role(req), self._echo_text(req),
                                         req.include_reasoning)  # fmt: skip
                finish_reason = shaper.finish_reason(finish_reason)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                    **({"token_ids": c.token_ids} if req.return_token_ids else {}),
                }
            )
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.reply_model(req.model),
            "choices": choices,
            "usage": self.usage(results, req.n),
            **transfer_field(results),
        }
        if req.return_token_ids:  # vLLM's extra
            body["prompt_token_ids"] = r.prompt_token_ids
        return body

    def _stream(
        self,
        req: ChatCompletionRequest,
        started: list[Started],
        rid: str,
        created: int,
        mode: ToolMode,
    ) -> SSEStream:
        shapers: dict[int, ChoiceShaper | None] = {}

        def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, fr: Any = None,
                  sr: Any = None) -> dict[str, Any]:  # fmt: skip
            c: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.reply_model(req.model),
                "choices": [
                    {
                        "index": index,
                        "delta": delta,
                        "logprobs": logprobs,
                        "finish_reason": fr,
                        "stop_reason": sr,
                    }
                ],
            }
            if req.include_usage:
                c["usage"] = None
            return c

        def first_chunks(s: Started) -> list[dict[str, Any]]:
            chunks = []
            echo = self._echo_text(req)
            for i in range(req.n):  # each choice opens with its role (as vLLM does)
                chunks.append(chunk(i, {"role": self._role(req), "content": ""}))
                if req.return_token_ids:  # vLLM's extra: the prompt's ids on the first chunk
                    chunks[-1]["prompt_token_ids"] = s.prompt_token_ids
                if echo:
                    chunks.append(chunk(i, {"content": echo}))
            return chunks

        def make_chunks(s: Started, c: CompletionOutput, out: RequestOutput
                        ) -> list[dict[str, Any]]:  # fmt: skip
            wants_ids = (req.logprobs or req.return_token_ids) and c.token_ids
            if not c.text and c.finish_reason is None and not wants_ids:
                return []
            logprobs = None
            if req.logprobs:
                logprobs = {"content": self._logprobs(Choice.of(c), req.top_logprobs or 0)}
            if c.index not in shapers:
                shapers[c.index] = self.shaper(mode, s.prompt_text)
            shaper = shapers[c.index]
            ids = {"token_ids": list(c.token_ids)} if req.return_token_ids else {}
            if shaper is None:
                delta = {"content": c.text} if c.text else {}
                made = chunk(c.index, delta, logprobs, c.finish_reason, c.stop_reason)
                made["choices"][0].update(ids)
                return [made]
            shaped = shaper.step(c.text, c.finish_reason is not None)
            delta: dict[str, Any] = {}
            if shaped.reasoning and req.include_reasoning:
                delta["reasoning_content"] = shaped.reasoning
            if shaped.content:
                delta["content"] = shaped.content
            if shaped.tool_calls:
                delta["tool_calls"] = shaped.tool_calls
            fr = shaper.finish_reason(c.finish_reason)
            if not delta and fr is None and logprobs is None and not ids:
                return []
            made = chunk(c.index, delta, logprobs, fr, c.stop_reason)
            made["choices"][0].update(ids)
            return [made]

        usage_chunk = self.usage_chunk(rid, "chat.completion.chunk", created, req.model)
        return self.stream_events(
            started,
            make_chunks,
            first_chunks,
            usage_chunk if req.include_usage else None,
            req.continuous_usage,
        )

    def _logprobs(self, r: Choice, num: int) -> list[dict[str, Any]]:
        """OpenAI's ``logprobs.content``: one entry per generated token with its top_logprobs
        (the ``num`` most likely tokens, by rank)."""
        content = []
        for tid, d in zip(r.token_ids, r.logprobs or []):
            lp = d.get(tid)
            tok = self.token_str(tid, lp)
            top: list[dict[str, Any]] = []
            for t, x in sorted(d.items(), key=lambda kv: kv[1].rank or 0):
                if x.rank is not None and x.rank <= num and len(top) < num:
                    top.append(self._entry(t, x))
            content.append(
                {
                    "token": tok,
                    "logprob": clamp_logprob(lp.logprob) if lp is not None else _MIN,
                    "bytes": list(tok.encode("utf-8")),
                    "top_logprobs": top,
                }
            )
        return content

    def _entry(self, token_id: int, lp: Logprob) -> dict[str, Any]:
        tok = self.token_str(token_id, lp)
        return {
            "token": tok,
            "logprob": clamp_logprob(lp.logprob),
            "bytes": list(tok.encode("utf-8")),
        }


_MIN = -9999.0
