"""Request bodies of the OpenAI-compatible API (pydantic); the error body is ``errors.py``.

Fields are OpenAI's plus vLLM's extras (``top_k, min_p, repetition_penalty, min_tokens,
ignore_eos, stop_token_ids, allowed_token_ids, bad_words, skip_special_tokens,
spaces_between_special_tokens, include_stop_str_in_output, echo, add_generation_prompt,
continue_final_message, add_special_tokens, priority, cache_salt, chat_template,
chat_template_kwargs, kv_transfer_params``), beam search
(``use_beam_search, length_penalty, early_stopping``, with ``n`` the beam width) and
structured outputs (``response_format``, ``guided_json, guided_regex, guided_choice,
guided_grammar``, ``structured_outputs``; see ``structured.py``).

Unknown fields are IGNORED, as vLLM does by default (OpenAI SDKs send fields a server may not
know, such as ``store`` or ``metadata``); their names are logged at WARNING level once per
request. Types are checked by pydantic (lax mode, like vLLM: ``"5"`` is accepted for an int);
value ranges are checked by ``SamplingParams`` itself, so the rules live in one place.
Responses are plain dicts built in ``completions.py`` / ``chat.py`` (faster to serialize than
pydantic models when streaming one chunk per token).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from pagedllm.beam_search import BeamSearchParams
from pagedllm.entrypoints.openai.errors import RequestError
from pagedllm.entrypoints.openai.structured import structured_outputs_of
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 128  # most sequences (n, best_of, beam width) one request may ask for
_LONG_MIN, _LONG_MAX = -(2**63), 2**64 - 1


class OpenAIBaseModel(BaseModel):
    """Ignores unknown fields and logs their names (vLLM's behaviour). Non-finite numbers
    (``Infinity``, ``NaN``: Python's JSON parser accepts them) are refused: 400 on the field."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _log_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = set(cls.model_fields)
            unknown = [k for k in data if k not in known]
            if unknown:
                logger.warning("ignored unknown request field(s): %s", ", ".join(unknown))
        return data


class StreamOptions(OpenAIBaseModel):
    """``stream_options``: usage in the last chunk (and, vLLM's extra, in every chunk)."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=_LONG_MIN, le=_LONG_MAX)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: dict[str, Any] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    echo: bool = False
    priority: int = 0
    cache_salt: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # KV-Compress (a server started with --enable-kvc)
    max_cache_tokens: int | None = None
    compression_rate: float | None = None
    protected_window_size: int | None = None
    compress_once: bool | None = None
    # prefill/decode disaggregation (a server started with --kv-transfer-config; the proxy
    # fills it in): {"do_remote_decode": true} on the prefill side, the prefill response's
    # kv_transfer_params on the decode side
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's extra: the prompt's and each choice's token ids in the reply (streamed: each
    # chunk's new ids, the prompt's on a choice's first chunk)
    return_token_ids: bool = False

    # the request field the structured-output constraint came from (for error messages)
    _structured_field: str | None = PrivateAttr(None)

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options can only be set when stream is true.",
                               param="stream_options")  # fmt: skip
        if self.cache_salt is not None and not self.cache_salt:
            raise RequestError("cache_salt must be a non-empty string.", param="cache_salt")

    @property
    def structured_field(self) -> str | None:
        """The field that asked for structured outputs (set by ``to_sampling_params``)."""
        return self._structured_field

    def set_structured_field(self, name: str) -> None:
        """The grammar came from ``name`` (e.g. ``tools``: a required or named tool call)."""
        self._structured_field = name

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None, best_of: int | None = None,
                         ) -> SamplingParams:  # fmt: skip
        structured, self._structured_field = structured_outputs_of(self)
        if best_of is not None and best_of > self.n and self.stream:
            raise RequestError(
                "best_of > n is not supported when streaming (the best sequences are known "
                "only at the end).",
                param="best_of",
            )
        try:
            return SamplingParams(
                n=self.n,
                best_of=best_of,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if self.repetition_penalty is None else self.repetition_penalty
                ),
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                logit_bias=self.logit_bias,  # string keys: SamplingParams makes them ints
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                structured_outputs=structured,
                max_cache_tokens=self.max_cache_tokens,
                compression_rate=self.compression_rate,
                protected_window_size=self.protected_window_size,
                compress_once=self.compress_once,
                extra_args=(
                    {"kv_transfer_params": self.kv_transfer_params}
                    if self.kv_transfer_params
                    else None
                ),
            )
        except ValueError as e:
            raise RequestError(str(e), param=param_of(str(e))) from e

    def _beam_params(self, max_tokens: int, beam_width: int, wants_logprobs: bool
                     ) -> BeamSearchParams:  # fmt: skip
        """BeamSearchParams for ``use_beam_search``; 400 naming the first field that beam
        search can not honour (it is deterministic, non-streaming, without logprobs)."""
        unsupported: list[tuple[str, bool]] = [
            ("stream", bool(self.stream)),
            ("logprobs", wants_logprobs),
            ("temperature", self.temperature not in (None, 0.0)),
            ("stop", bool(self.stop)),
            ("stop_token_ids", bool(self.stop_token_ids)),
            ("min_tokens", self.min_tokens > 0),
            ("presence_penalty", bool(self.presence_penalty)),
            ("frequency_penalty", bool(self.frequency_penalty)),
            ("repetition_penalty", self.repetition_penalty not in (None, 1.0)),
            ("logit_bias", bool(self.logit_bias)),
            ("allowed_token_ids", self.allowed_token_ids is not None),
            ("bad_words", bool(self.bad_words)),
            ("cache_salt", self.cache_salt is not None),
            ("kv_transfer_params", self.kv_transfer_params is not None),
        ]
        for name, bad in unsupported:
            if bad:
                raise RequestError(
                    f"{name} is not supported with use_beam_search (beam search is greedy, "
                    "non-streaming and returns no logprobs).",
                    param=name,
                )
        source = structured_outputs_of(self)[1]
        if source is not None:
            raise RequestError("structured outputs are not supported with use_beam_search.",
                               param=source)  # fmt: skip
        try:
            return BeamSearchParams(
                beam_width=beam_width,
                max_tokens=max_tokens,
                ignore_eos=self.ignore_eos,
                length_penalty=self.length_penalty,
                early_stopping=self.early_stopping,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ValueError as e:
            raise RequestError(str(e), param=param_of(str(e)) or "use_beam_search") from e

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        so = self.stream_options
        return bool(self.stream and so and so.include_usage and so.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one per choice; RequestError if empty."""
        p = self.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif len(p) == 0:
            raise RequestError("prompt must not be empty.", param="prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        for item in items:
            if len(item) == 0:
                raise RequestError("prompt must not be empty.", param="prompt")
        return items

    def to_sampling_params(self) -> SamplingParams:
        """SamplingParams of this request (RequestError naming the field if out of range)."""
        self._check_common()
        if self.suffix:
            raise RequestError("suffix is not supported.", param="suffix")
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs,
                                     self.best_of)  # fmt: skip

    def to_beam_search_params(self, default_max_tokens: int) -> BeamSearchParams:
        """``use_beam_search``: beam width ``best_of`` (or ``n``); the n best are returned."""
        self._check_common()
        if self.suffix:
            raise RequestError("suffix is not supported.", param="suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise RequestError(f"best_of must be >= n ({self.n}), got {self.best_of}.",
                               param="best_of")  # fmt: skip
        max_tokens = self.max_tokens if self.max_tokens is not None else default_max_tokens
        width = self.best_of or self.n
        return self._beam_params(max_tokens, width, self.logprobs is not None)


class ChatMessage(OpenAIBaseModel):
    """One message; ``content`` is a string or a list of ``{"type": "text", "text": ...}``.
    An assistant message may carry the ``tool_calls`` it made (and ``reasoning_content``), a
    ``tool`` message the ``tool_call_id`` it answers."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The text of the content (text parts joined with newlines)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"only text content parts are supported, got type {part.get('type')!r}.",
                    param="messages",
                )
            parts.append(part["text"])
        return "\n".join(parts)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    # None: OpenAI's default, "auto" when tools are given, else "none" (see tools.py)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras
    include_reasoning: bool = True  # reasoning_content in the reply (--reasoning-parser)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens  # fmt: skip

    def _check_chat(self) -> int | None:
        """Checks chat's own fields; returns max_tokens as the body gives it (or None)."""
        self._check_common()
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true.", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError(
                "continue_final_message and add_generation_prompt can not both be true.",
                param="continue_final_message",
            )
        return self.max_new_tokens()

    def to_sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        """SamplingParams of this request; ``default_max_tokens`` when the body gives none."""
        max_tokens = self._check_chat()
        if max_tokens is None:
            max_tokens = default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, None)

    def to_beam_search_params(self, default_max_tokens: int) -> BeamSearchParams:
        """``use_beam_search``: beam width ``n``, all n hypotheses returned as choices."""
        max_tokens = self._check_chat()
        if max_tokens is None:
            max_tokens = default_max_tokens
        return self._beam_params(max_tokens, self.n, bool(self.logprobs))

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as plain dicts for the chat template. An assistant's tool calls keep
        their shape, with ``arguments`` decoded from JSON text to an object (what templates
        such as Qwen's and Llama's expect; vLLM does the same)."""
        conv = []
        for i, m in enumerate(self.messages):
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                d["tool_calls"] = [_template_call(c, i) for c in m.tool_calls]
            conv.append(d)
        return conv


def _template_call(call: dict[str, Any], index: int) -> dict[str, Any]:
    """One tool call of message ``index`` for the chat template; 400 naming ``messages``."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"messages[{index}].tool_calls: each call needs function.name.",
                           param="messages")  # fmt: skip
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise RequestError(
                f"messages[{index}].tool_calls: arguments of {fn['name']!r} are not JSON: {e}.",
                param="messages",
            ) from e
    return {**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}}


class TokenizeRequest(OpenAIBaseModel):
    """``POST /tokenize``: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_of(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages.")
        if self.messages is not None and not self.messages:
            raise RequestError("messages must not be empty.", "messages")
        return self


class LoRAAdapterRequest(OpenAIBaseModel):
    """``POST /v1/load_lora_adapter`` (name and PEFT folder) and ``/v1/unload_lora_adapter``
    (name)."""

    lora_name: str | None = None
    lora_path: str | None = None
    base_model_name: str | None = None


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


_PARAM_NAMES = set(SamplingParams.__dataclass_fields__) | {"prompt", "messages", "model"}


def param_of(message: str) -> str | None:
    """The field an engine ValueError names: its first word, if that is a request field."""
    word = message.split(" ", 1)[0].strip(":,.'\"`")
    if word in _PARAM_NAMES:
        return word
    if word.startswith("prompt"):
        return "prompt"
    return None


def random_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in seconds (the ``created`` field)."""
    return int(time.time())


FinishReason = Literal["stop", "length", "abort"]
