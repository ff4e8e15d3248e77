"""``POST /v1/chat/completions``: render the chat template, generate, answer in OpenAI's format.

The template comes from (first found): the request's ``chat_template`` (a vLLM extra), the
server's ``--chat-template`` (a file path or an inline Jinja string), the tokenizer's own (HF
``tokenizer_config.json`` or the GGUF's ``tokenizer.chat_template`` metadata).
"""

from __future__ import annotations

import os
from typing import Any

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.completions import (
    Collected,
    ServingBase,
    SSEStream,
    Started,
    clamp_logprob,
    usage_dict,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    RequestError,
    now,
    random_id,
)
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

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


class ServingChat(ServingBase):
    """Chat completions on top of ``ServingBase``."""

    def __init__(self, llm: AsyncLLM, model_name: str, chat_template: str | None = None) -> None:
        super().__init__(llm, model_name)
        self.chat_template = chat_template

    def render(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        """(prompt text, token ids) of the conversation under the chat template."""
        template = req.chat_template or self.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                "this model has no chat template; start the server with --chat-template, or "
                "use /v1/completions.",
                param="messages",
            )
        kwargs = {
            k: v
            for k, v in (req.chat_template_kwargs or {}).items()
            if k not in _RESERVED_TEMPLATE_KWARGS
        }
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

    def prepare(self, req: ChatCompletionRequest) -> tuple[str, list[int], SamplingParams]:
        """Check, render and tokenize: (prompt text, ids, sampling params)."""
        self.check_model(req.model)
        params = req.to_sampling_params()
        text, ids = self.render(req)
        if not ids:
            raise RequestError("the rendered conversation has no tokens.", param="messages")
        self.check_length(len(ids), req.max_new_tokens(), "messages")
        try:
            self.llm.validate({"prompt": text, "prompt_token_ids": ids}, params)
        except ValueError as e:
            raise RequestError(str(e), param="messages") from e
        return text, ids, params

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
        text, ids, params = self.prepare(req)
        rid = random_id("chatcmpl")
        started = await self.start([(text, ids)], params, rid, req.priority)
        created = now()
        if req.stream:
            return self._stream(req, started, rid, created)
        (r,) = await self.collect(started)
        logprobs = None
        if req.logprobs:
            logprobs = {"content": self._logprobs(r, req.top_logprobs or 0)}
        message = {"role": self._role(req), "content": self._echo_text(req) + r.text}
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                }
            ],
            "usage": usage_dict(len(ids), len(r.token_ids)),
        }

    def _stream(
        self, req: ChatCompletionRequest, started: list[Started], rid: str, created: int
    ) -> SSEStream:
        def chunk(delta: dict[str, Any], logprobs: Any = None, fr: Any = None, sr: Any = None
                  ) -> dict[str, Any]:  # fmt: skip
            c: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
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
            chunks = [chunk({"role": self._role(req), "content": ""})]
            echo = self._echo_text(req)
            if echo:
                chunks.append(chunk({"content": echo}))
            return chunks

        def make_chunks(s: Started, out: RequestOutput) -> list[dict[str, Any]]:
            c = out.outputs[0]
            if not c.text and c.finish_reason is None and not (req.logprobs and c.token_ids):
                return []
            logprobs = None
            if req.logprobs:
                col = Collected(None, [], c.text, list(c.token_ids), list(c.logprobs or []))
                logprobs = {"content": self._logprobs(col, req.top_logprobs or 0)}
            delta = {"content": c.text} if c.text else {}
            return [chunk(delta, logprobs, c.finish_reason, c.stop_reason)]

        def usage_chunk(usage: dict[str, int]) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": usage,
            }

        return self.stream_events(
            started,
            make_chunks,
            first_chunks,
            usage_chunk if req.include_usage else None,
            req.continuous_usage,
        )

    def _logprobs(self, r: Collected, num: int) -> list[dict[str, Any]]:
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
