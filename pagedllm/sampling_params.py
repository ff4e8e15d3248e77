"""Sampling parameters of one request, named and validated as vLLM names them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

# vLLM's import paths: ``from vllm.sampling_params import StructuredOutputsParams,
# BeamSearchParams`` works here with ``pagedllm``
from pagedllm.beam_search import BeamSearchParams
from pagedllm.structured_output.params import StructuredOutputsParams

__all__ = ["BeamSearchParams", "SamplingParams", "SamplingType", "StructuredOutputsParams"]

_SAMPLING_EPS = 1e-5
MAX_STOP_STRINGS = 64  # per request (OpenAI allows 4; vLLM has no bound)
MAX_STOP_STRING_CHARS = 1024


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    temperature 0 means greedy. Validation happens in ``__post_init__`` and raises ``ValueError``
    naming the offending field, so bad input never reaches the engine loop.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: object | None = None  # StructuredOutputsParams or an equivalent dict
    # KV-Compress (an engine started with enable_kvc): this request's KV budget, as tokens per
    # layer and KV head or as a rate (8 = keep an eighth); the last protected_window_size
    # tokens are never evicted; compress_once: only after the prompt. None: the engine default.
    max_cache_tokens: int | None = None
    compression_rate: float | None = None
    protected_window_size: int | None = None
    compress_once: bool | None = None
    # Set by the engine, never by users: beam-search requests take their tokens from the
    # scheduler (the runner must not append its own), and best_of > n computes logprobs only
    # to rank sequences (they are not returned).
    external_tokens: bool = field(default=False, repr=False)
    hide_logprobs: bool = field(default=False, repr=False)
    # KV-Compress, for measurements (the quality benchmark's teacher-forced loss): evict once
    # the first ``kvc_compress_at`` prompt tokens are computed (the prefill stops there for a
    # step), so the rest of the prompt - and its prompt_logprobs - sees the compressed cache.
    kvc_compress_at: int | None = field(default=None, repr=False)
    # Filled by the engine: the model's EOS ids, beyond which stop_token_ids also stop.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)

    def _verify(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            got = repr(getattr(self, name))
            got = got if len(got) <= 200 else got[:200] + "..."  # a 100,000-string stop list
            return ValueError(f"{name} {why}, got {got}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.best_of is not None:
            if not isinstance(self.best_of, int) or self.best_of < self.n:
                raise bad("best_of", f"must be an integer >= n ({self.n})")
            if self.best_of > 1 and self.temperature < _SAMPLING_EPS:
                raise bad("best_of", "must be 1 (or unset) for greedy sampling")

        if not self.temperature >= 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be -1 (disable), 0 (disable) or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be greater than zero")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be at least 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be less than or equal to max_tokens={self.max_tokens}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", "must be non-negative")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must contain only non-empty strings")
        # bounds: every stop string is searched for in every new piece of text of the request
        # (100,000 of them slowed the whole engine ~30%)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"must hold at most {MAX_STOP_STRINGS} strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters long")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            raise bad("stop_token_ids", f"must hold at most {MAX_STOP_STRINGS} ids")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must contain only non-negative integers")
        self._verify_kvc(bad)

    def _verify_kvc(self, bad) -> None:  # noqa: ANN001
        from pagedllm.config import check_compression_rate

        m = self.max_cache_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise bad("max_cache_tokens", "must be a positive integer")
        check_compression_rate(self.compression_rate)
        if m is not None and self.compression_rate is not None:
            raise bad("compression_rate", "cannot be set together with max_cache_tokens")
        w = self.protected_window_size
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise bad("protected_window_size", "must be a non-negative integer")
        if self.compress_once is not None and not isinstance(self.compress_once, bool):
            raise bad("compress_once", "must be a boolean")

    @property
    def uses_kvc_fields(self) -> bool:
        """Whether any KV-Compress field is set (an engine without KV-Compress refuses it)."""
        return any(
            v is not None
            for v in (
                self.max_cache_tokens,
                self.compression_rate,
                self.protected_window_size,
                self.compress_once,
            )
        )

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def num_sequences(self) -> int:
        """Sequences generated for the request: best_of when set (the n best are returned),
        else n."""
        return max(self.n, self.best_of or self.n)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
