"""``POST /v1/completions``, and ``ServingBase``: what completions and chat share (model check,
length check, starting requests, collecting and streaming their outputs as SSE)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError, EngineError, RequestStream
from pagedllm.entrypoints.openai.protocol import (
    CompletionRequest,
    ErrorResponse,
    RequestError,
    now,
    param_of,
    random_id,
)
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM sends this instead


def clamp_logprob(lp: float | None) -> float | None:
    """A JSON-safe logprob (``-inf`` -> -9999.0)."""
    if lp is None:
        return None
    return max(lp, _MIN_LOGPROB) if not math.isnan(lp) else _MIN_LOGPROB


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class Collected:
    """A finished choice: everything the deltas of one request added up to."""

    prompt_text: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(c.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


@dataclass
class SSEStream:
    """A streaming response: its SSE text, and the requests to abort if it never finishes."""

    events: AsyncIterator[str]
    started: list[Started]

    def abort(self) -> None:
        """Abort every request of this response that is still running (idempotent)."""
        _abort_all(self.started)


@dataclass
class Started:
    """A request accepted by the engine, with what the response needs about its prompt."""

    index: int
    stream: RequestStream
    prompt_text: str | None
    prompt_token_ids: list[int]


class ServingBase:
    """Shared by the completion and chat handlers."""

    def __init__(self, llm: AsyncLLM, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.model_config.max_model_len

    def check_model(self, model: str | None) -> None:
        """404 (vLLM's message) when the body names a model this server does not serve."""
        if model is not None and model != self.model_name:
            raise RequestError(
                f"The model `{model}` does not exist.",
                param="model",
                status_code=404,
                err_type="NotFoundError",
            )

    def check_length(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        """400 when the prompt (plus ``max_tokens`` if given) exceeds the context (vLLM)."""
        if num_prompt > self.max_model_len or (
            max_tokens is not None and num_prompt + max_tokens > self.max_model_len
        ):
            what = "messages" if param == "messages" else "prompt"
            asked = num_prompt + (max_tokens or 0)
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {asked} tokens ({num_prompt} in the {what}, {max_tokens or 0} "
                f"in the completion). Please reduce the length of the {what} or completion.",
                param=param,
            )

    async def start(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams,
        request_id: str,
        priority: int,
    ) -> list[Started]:
        """Queue one engine request per prompt (all or none: a failure aborts the started)."""
        started: list[Started] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                prompt = {"prompt": text, "prompt_token_ids": ids}
                stream = await self.llm.add_request(prompt, params, rid, priority)
                started.append(Started(i, stream, text, ids))
        except ValueError as e:
            _abort_all(started)
            raise RequestError(str(e), param=param_of(str(e))) from e
        except BaseException:
            _abort_all(started)
            raise
        return started

    async def collect(self, started: list[Started]) -> list[Collected]:
        """Run every request to its end; aborts them all if cancelled (client went away)."""

        async def one(s: Started) -> Collected:
            c = Collected(s.prompt_text, s.prompt_token_ids)
            async for out in s.stream:
                c.add(out)
            return c

        try:
            return list(await asyncio.gather(*(one(s) for s in started)))
        finally:
            _abort_all(started)

    def stream_events(
        self,
        started: list[Started],
        make_chunks: Callable[[Started, RequestOutput], list[dict[str, Any]]],
        first_chunks: Callable[[Started], list[dict[str, Any]]],
        usage_chunk: Callable[[dict[str, int]], dict[str, Any]] | None,
        continuous_usage: bool,
    ) -> SSEStream:
        """SSE text of all requests interleaved, then the usage chunk (if asked) and [DONE].

        Cancellation (client disconnect) or a closed generator aborts every unfinished request.
        """
        return SSEStream(self._events(started, make_chunks, first_chunks, usage_chunk,
                                      continuous_usage), started)  # fmt: skip

    async def _events(
        self,
        started: list[Started],
        make_chunks: Callable[[Started, RequestOutput], list[dict[str, Any]]],
        first_chunks: Callable[[Started], list[dict[str, Any]]],
        usage_chunk: Callable[[dict[str, int]], dict[str, Any]] | None,
        continuous_usage: bool,
    ) -> AsyncIterator[str]:
        prompt_tokens = sum(len(s.prompt_token_ids) for s in started)
        gen_tokens = 0
        try:
            for s in started:
                for chunk in first_chunks(s):
                    yield sse(chunk)
            async for s, out in _interleave(started):
                gen_tokens += len(out.outputs[0].token_ids)
                for chunk in make_chunks(s, out):
                    if continuous_usage:
                        chunk["usage"] = usage_dict(prompt_tokens, gen_tokens)
                    yield sse(chunk)
            if usage_chunk is not None:
                yield sse(usage_chunk(usage_dict(prompt_tokens, gen_tokens)))
        except (EngineError, EngineDeadError) as e:
            err = RequestError(str(e), status_code=500, err_type="InternalServerError")
            yield sse(ErrorResponse.of(err).model_dump())
        finally:
            _abort_all(started)
        yield SSE_DONE

    def token_str(self, token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])


async def _interleave(started: list[Started]) -> AsyncIterator[tuple[Started, RequestOutput]]:
    """Outputs of several streams in arrival order (one stream: no extra tasks)."""
    if len(started) == 1:
        s = started[0]
        async for out in s.stream:
            yield s, out
        return
    queue: asyncio.Queue[tuple[Started, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(s: Started) -> None:
        try:
            async for out in s.stream:
                queue.put_nowait((s, out))
            queue.put_nowait((s, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((s, e))

    tasks = [asyncio.create_task(pump(s)) for s in started]
    try:
        remaining = len(tasks)
        while remaining:
            s, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield s, item
    finally:
        for t in tasks:
            t.cancel()


def _abort_all(started: list[Started]) -> None:
    for s in started:
        s.stream.abort()


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ServingCompletion(ServingBase):
    """The legacy completions endpoint, with vLLM's extras (echo, prompt logprobs, ...)."""

    def prepare(self, req: CompletionRequest) -> tuple[list[tuple[str | None, list[int]]],
                                                       SamplingParams]:  # fmt: skip
        """Check and tokenize: ((prompt text, ids) per prompt, sampling params)."""
        self.check_model(req.model)
        params = req.to_sampling_params()
        prompts: list[tuple[str | None, list[int]]] = []
        for p in req.prompts():
            if isinstance(p, str):
                ids = list(self.tokenizer.encode(p, add_special_tokens=req.add_special_tokens))
                text: str | None = p
            else:
                ids, text = list(p), None
            self.check_length(len(ids), req.max_tokens, "prompt")
            try:
                text, ids = self.llm.validate({"prompt": text, "prompt_token_ids": ids}, params)
            except ValueError as e:
                raise RequestError(str(e), param="prompt") from e
            prompts.append((text, ids))
        return prompts, params

    async def create(self, req: CompletionRequest) -> dict[str, Any] | SSEStream:
        """The response body (dict) or, when streaming, an SSE text iterator."""
        prompts, params = self.prepare(req)
        rid = random_id("cmpl")
        started = await self.start(prompts, params, rid, req.priority)
        created = now()
        if req.stream:
            return self._stream(req, started, rid, created)
        results = await self.collect(started)
        choices = []
        for i, r in enumerate(results):
            text, logprobs = r.text, None
            if req.echo:
                text = self._prompt_text(r.prompt_text, r.prompt_token_ids) + r.text
            if req.logprobs is not None:
                logprobs = self._logprobs(r, req.logprobs, req.echo, 0)
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                }
            )
        n_prompt = sum(len(r.prompt_token_ids) for r in results)
        n_gen = sum(len(r.token_ids) for r in results)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage_dict(n_prompt, n_gen),
        }

    def _prompt_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.tokenizer.decode(ids)

    def _stream(
        self, req: CompletionRequest, started: list[Started], rid: str, created: int
    ) -> SSEStream:
        offsets = [0] * len(started)  # text already sent per choice (for text_offset)
        sent_first = [False] * len(started)

        def chunk(index: int, text: str, logprobs: Any, fr: Any, sr: Any) -> dict[str, Any]:
            c: dict[str, Any] = {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [
                    {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": fr,
                        "stop_reason": sr,
                    }
                ],
            }
            if req.include_usage:
                c["usage"] = None
            return c

        def make_chunks(s: Started, out: RequestOutput) -> list[dict[str, Any]]:
            c = out.outputs[0]
            echo_now = req.echo and not sent_first[s.index]
            sent_first[s.index] = True
            col = Collected(s.prompt_text, s.prompt_token_ids, c.text, list(c.token_ids),
                            list(c.logprobs) if c.logprobs is not None else None)  # fmt: skip
            text = c.text
            if echo_now:  # like vLLM: the prompt rides on the first chunk of its choice
                text = self._prompt_text(s.prompt_text, s.prompt_token_ids) + text
                col.prompt_logprobs = out.prompt_logprobs
            if not text and c.finish_reason is None and (req.logprobs is None or not c.token_ids):
                return []
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._logprobs(col, req.logprobs, echo_now, offsets[s.index])
            offsets[s.index] += len(text)
            return [chunk(s.index, text, logprobs, c.finish_reason, c.stop_reason)]

        def usage_chunk(usage: dict[str, int]) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": usage,
            }

        return self.stream_events(
            started,
            make_chunks,
            lambda s: [],
            usage_chunk if req.include_usage else None,
            req.continuous_usage,
        )

    def _logprobs(self, r: Collected, num: int, echo: bool, offset: int) -> dict[str, Any]:
        """OpenAI's legacy logprobs object: tokens, token_logprobs, top_logprobs, text_offset
        (character offsets into the choice's text, starting at ``offset``)."""
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        rows: list[tuple[int, dict[int, Logprob] | None]] = []
        if echo:
            plp = r.prompt_logprobs or [None] * len(r.prompt_token_ids)
            rows.extend(zip(r.prompt_token_ids, plp))
        rows.extend(zip(r.token_ids, r.logprobs or [None] * len(r.token_ids)))
        for tid, d in rows:
            lp = d.get(tid) if d else None
            tokens.append(self.token_str(tid, lp))
            token_lps.append(clamp_logprob(lp.logprob) if lp is not None else None)
            if d is None:
                tops.append(None)
                continue
            top = sorted(d.items(), key=lambda kv: kv[1].rank or 0)
            entries = [(t, x) for t, x in top if (x.rank or 0) <= num or t == tid]
            tops.append({self.token_str(t, x): clamp_logprob(x.logprob) for t, x in entries})
        text_offset = []
        pos = offset
        for t in tokens:
            text_offset.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": text_offset,
        }
