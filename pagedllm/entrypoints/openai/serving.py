"""``ServingBase``: what completions and chat share. Model and length checks, the structured-
output pre-check, starting engine requests (sampling or beam search), collecting their outputs
and streaming them as server-sent events in OpenAI's chunk format.

Choices: a request for ``P`` prompts with ``n`` sequences each answers ``P x n`` choices; choice
``p x n + i`` is sequence ``i`` of prompt ``p`` (vLLM's numbering). When streaming, every chunk
carries one choice with its ``index``; a choice's ``finish_reason`` comes in its own last chunk.
Usage counts each prompt once and the tokens of every returned choice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm.beam_search import BeamSearchParams
from pagedllm.engine.async_llm import AsyncLLMBase, EngineDeadError, EngineError, RequestStream
from pagedllm.entrypoints.openai.errors import ErrorResponse, RequestError
from pagedllm.entrypoints.openai.models import ServingModels
from pagedllm.entrypoints.openai.protocol import param_of
from pagedllm.entrypoints.openai.structured import compile_error_message
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM sends this instead
GRAMMAR_TIMEOUT_S = 60.0  # a grammar that compiles longer than this is refused (400)

Prompt = tuple[str | None, list[int]]  # (prompt text if known, token ids)


def clamp_logprob(lp: float | None) -> float | None:
    """A JSON-safe logprob (``-inf`` -> -9999.0)."""
    if lp is None:
        return None
    return max(lp, _MIN_LOGPROB) if not math.isnan(lp) else _MIN_LOGPROB


# one encoder for every event (json.dumps with options builds one per call: ~1 us a chunk)
_ENCODE = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {_ENCODE(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class Choice:
    """One generated sequence: everything its deltas added up to."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @classmethod
    def of(cls, c: CompletionOutput) -> Choice:
        """A choice holding just this delta (for one streamed chunk)."""
        choice = cls(c.index)
        choice.add(c)
        return choice

    def add(self, c: CompletionOutput) -> None:
        self.text += c.text
        self.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(c.logprobs)
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


@dataclass
class Collected:
    """A finished request: its prompt, its choices by sequence index, the prefix-cache hit
    and the engine's error if it ended the request early (e.g. a grammar failure)."""

    prompt_text: str | None
    prompt_token_ids: list[int]
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params: dict | None = None  # a KV producer's: where the prompt's KV went

    def add(self, out: RequestOutput) -> None:
        for c in out.outputs:
            self.choices.setdefault(c.index, Choice(c.index)).add(c)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.error = out.error or self.error
        self.kv_transfer_params = out.kv_transfer_params or self.kv_transfer_params

    def ordered(self, n: int) -> list[Choice]:
        """The first ``n`` choices by index (beam search: the n best hypotheses)."""
        return [self.choices[i] for i in sorted(self.choices)][:n]


@dataclass
class Started:
    """A request accepted by the engine, with what the response needs about its prompt:
    ``index`` is the prompt's position, ``n`` the choices it answers."""

    index: int
    stream: RequestStream
    prompt_text: str | None
    prompt_token_ids: list[int]
    n: int = 1

    def choice_index(self, seq_index: int) -> int:
        return self.index * self.n + seq_index


@dataclass
class SSEStream:
    """A streaming response: its SSE text, and the requests to abort if it never finishes."""

    events: AsyncIterator[str]
    started: list[Started]

    def abort(self) -> None:
        """Abort every request of this response that is still running (idempotent)."""
        _abort_all(self.started)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
               ) -> dict[str, Any]:  # fmt: skip
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` is the prefix-cache hit."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def engine_error(message: str) -> RequestError:
    """The HTTP error for a request the engine ended early: 400 if its grammar was invalid
    (the compiler's message) or the engine core refused it as invalid (a ValueError at
    admission, e.g. a KV transfer that is missing), else 500."""
    if message.startswith(("invalid ", "JSON schema is ")):  # GrammarCompileError
        return RequestError(compile_error_message(message))
    if message.startswith("ValueError: "):
        return RequestError(message.removeprefix("ValueError: "))
    return RequestError(message, status_code=500, err_type="InternalServerError")


def transfer_field(results: list[Collected]) -> dict[str, Any]:
    """A KV producer's response field ``kv_transfer_params`` (vLLM's), when it has one."""
    params = next((r.kv_transfer_params for r in results if r.kv_transfer_params), None)
    return {"kv_transfer_params": params} if params else {}


def internal_error(e: BaseException) -> RequestError:
    """The HTTP error for an engine failure: 500, or the exception's ``status_code`` (503 for a
    request cut by the server's shutdown)."""
    status = getattr(e, "status_code", 500)
    kind = "ServiceUnavailable" if status == 503 else "InternalServerError"
    return RequestError(str(e), status_code=status, err_type=kind)


# Tokenization and chat templating run here, one at a time (a fast tokenizer is not meant for
# concurrent encodes), never on the event loop: a long prompt must not freeze other clients.
_TOKENIZE_POOL = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenize")


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the tokenizer thread, awaited from the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZE_POOL, fn, *args)


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of the vocabulary stands for (its string form; special
    tokens included), at least 1."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max([len(t) for t in tokens if t] or [1])


class ServingBase:
    """Shared by the completion and chat handlers."""

    def __init__(
        self,
        llm: AsyncLLMBase,
        model_name: str,
        longest_token: concurrent.futures.Future[int] | None = None,
    ) -> None:
        self.llm = llm
        self.model_name = model_name
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.model_config.max_model_len
        self._max_chars: int | None = None
        # ``longest_token_chars`` of the tokenizer: another handler's (one scan per server), or
        # a scan (~0.1 s) started now on the tokenizer thread, not on a request's loop turn
        self.longest_token = longest_token or _TOKENIZE_POOL.submit(
            longest_token_chars, self.tokenizer
        )
        # called with every engine request this handler starts (the server's drain tracks them)
        self.track: Callable[[RequestStream], None] = lambda stream: None
        self.models: ServingModels | None = None  # the base model and its adapters (server)

    def check_text_fits(self, num_chars: int, param: str) -> None:
        """400 before tokenizing when ``num_chars`` characters cannot fit the context: each
        token stands for at most ``longest_token_chars`` characters, so more than twice
        ``max_model_len`` times that (a margin for normalizers) is too long whatever the text.
        Example: max_model_len 512, longest token 16 characters -> over 16,384 refused."""
        if self._max_chars is None:
            self._max_chars = 2 * self.max_model_len * self.longest_token.result()
        if num_chars > self._max_chars:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens; the "
                f"{param} has {num_chars} characters, more than any {self.max_model_len} "
                "tokens can hold. Please reduce its length.",
                param=param,
            )

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter the body's ``model`` names (None: the base model); 404 (vLLM's
        message) when it names a model this server does not serve."""
        if self.models is not None:
            return self.models.resolve(model)
        if model is not None and model != self.model_name:
            raise RequestError(
                f"The model `{model}` does not exist.",
                param="model",
                status_code=404,
                err_type="NotFoundError",
            )
        return None

    def reply_model(self, model: str | None) -> str:
        """The ``model`` a reply names: the adapter the request named (vLLM's), else the base
        model's served name."""
        if self.models is not None and model in self.models.adapters:
            return model  # type: ignore[return-value]
        return self.model_name

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

    def check_num_seqs(self, num: int, param: str) -> None:
        """400 when one request asks for more sequences (n, best_of, beam width) than one batch
        holds (``--max-num-seqs``): the engine runs a request's sequences together."""
        limit = self.llm.config.scheduler_config.max_num_seqs
        if num > limit:
            raise RequestError(
                f"{param} is {num}, more than this server's max_num_seqs ({limit}): all "
                "sequences of one request must fit in one batch.",
                param=param,
            )

    async def check_structured(self, params: SamplingParams, param: str | None) -> None:
        """Compile the request's grammar (off the event loop and the engine thread); 400 with
        the compiler's message if it does not compile, or not within GRAMMAR_TIMEOUT_S."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.wait_for(self.llm.check_structured_outputs(params), GRAMMAR_TIMEOUT_S)
        except asyncio.TimeoutError as e:
            raise RequestError(
                f"the {param or 'structured output'} grammar did not compile within "
                f"{GRAMMAR_TIMEOUT_S:g} s.",
                param=param,
            ) from e
        except ValueError as e:
            raise RequestError(compile_error_message(e), param=param) from e

    async def start(
        self,
        prompts: list[Prompt],
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
        n: int = 1,
        output_kind: str = "delta",
        lora_request: LoRARequest | None = None,
    ) -> list[Started]:
        """Queue one engine request per prompt (all or none: a failure aborts the started).
        ``n`` is how many choices each prompt answers; ``lora_request`` the adapter."""
        started: list[Started] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
                if isinstance(params, BeamSearchParams):
                    stream = await self.llm.add_beam_request(prompt, params, rid, lora_request)
                else:
                    if cache_salt is not None:
                        prompt["cache_salt"] = cache_salt
                    stream = await self.llm.add_request(prompt, params, rid, priority, output_kind,
                                                        lora_request=lora_request)  # fmt: skip
                self.track(stream)
                started.append(Started(i, stream, text, ids, n))
        except ValueError as e:
            _abort_all(started)
            raise RequestError(str(e), param=param_of(str(e))) from e
        except BaseException:
            _abort_all(started)
            raise
        return started

    async def collect(self, started: list[Started]) -> list[Collected]:
        """Run every request to its end; aborts them all if cancelled (client went away).
        RequestError if the engine ended one early (400 for a grammar error, else 500)."""

        async def one(s: Started) -> Collected:
            c = Collected(s.prompt_text, s.prompt_token_ids)
            async for out in s.stream:
                c.add(out)
            return c

        try:
            results = list(await asyncio.gather(*(one(s) for s in started)))
        finally:
            _abort_all(started)
        for r in results:
            if r.error is not None:
                raise engine_error(r.error)
        return results

    @staticmethod
    def usage(results: list[Collected], n: int) -> dict[str, Any]:
        """Usage of a finished response: prompts once each, the tokens of every choice."""
        return usage_dict(
            sum(len(r.prompt_token_ids) for r in results),
            sum(len(c.token_ids) for r in results for c in r.ordered(n)),
            sum(r.num_cached_tokens for r in results),
        )

    def usage_chunk(
        self, rid: str, obj: str, created: int, model: str | None = None
    ) -> Callable[[dict[str, Any]], dict[str, Any]]:
        """The closing stream chunk that carries only usage (``obj`` is the chunk's object)."""

        def make(usage: dict[str, Any]) -> dict[str, Any]:
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.reply_model(model),
                "choices": [],
                "usage": usage,
            }

        return make

    def stream_events(
        self,
        started: list[Started],
        make_chunks: Callable[[Started, CompletionOutput, RequestOutput], list[dict[str, Any]]],
        first_chunks: Callable[[Started], list[dict[str, Any]]],
        usage_chunk: Callable[[dict[str, Any]], dict[str, Any]] | None,
        continuous_usage: bool,
    ) -> SSEStream:
        """SSE text of all requests interleaved, then the usage chunk (if asked) and [DONE].
        ``make_chunks`` is called once per sequence that changed in an output.

        Cancellation (client disconnect) or a closed generator aborts every unfinished request.
        """
        return SSEStream(self._events(started, make_chunks, first_chunks, usage_chunk,
                                      continuous_usage), started)  # fmt: skip

    async def _events(
        self,
        started: list[Started],
        make_chunks: Callable[[Started, CompletionOutput, RequestOutput], list[dict[str, Any]]],
        first_chunks: Callable[[Started], list[dict[str, Any]]],
        usage_chunk: Callable[[dict[str, Any]], dict[str, Any]] | None,
        continuous_usage: bool,
    ) -> AsyncIterator[str]:
        prompt_tokens = sum(len(s.prompt_token_ids) for s in started)
        gen_tokens = 0
        cached: dict[int, int] = {}
        # one write per output (all its chunks); the last output's events wait for the usage
        # chunk and [DONE], which end the response in the same write
        tail: list[str] = []
        try:
            for s in started:
                for chunk in first_chunks(s):
                    yield sse(chunk)
            running = len(started)
            async for s, out in _interleave(started):
                for c in out.outputs:
                    gen_tokens += len(c.token_ids)
                cached[s.index] = max(cached.get(s.index, 0), out.num_cached_tokens)
                events = []
                for c in out.outputs:
                    for chunk in make_chunks(s, c, out):
                        if continuous_usage:
                            chunk["usage"] = usage_dict(prompt_tokens, gen_tokens)
                        events.append(sse(chunk))
                if out.error is not None:
                    events.append(sse(ErrorResponse.of(engine_error(out.error)).model_dump()))
                running -= out.finished
                if running > 0:
                    if events:
                        yield "".join(events)
                else:
                    tail = events
            if usage_chunk is not None:
                usage = usage_dict(prompt_tokens, gen_tokens, sum(cached.values()))
                tail.append(sse(usage_chunk(usage)))
        except (EngineError, EngineDeadError) as e:
            tail.append(sse(ErrorResponse.of(internal_error(e)).model_dump()))
        finally:
            _abort_all(started)
        yield "".join(tail) + SSE_DONE

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
