"""Sampling parameters of one request, named and validated as vLLM names them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

# vLLM's import paths: ``from vllm.sampling_params import StructuredOutputsParams,
# BeamSearchParams`` works here with ``pagedllm``
from pagedllm.beam_search import BeamSearchParams
from pagedllm.structured_output.params import StructuredOutputsParams

__all__ = ["BeamSearchParams", "SamplingParams", "SamplingType", "StructuredOutputsParams"]

_SAMPLING_EPS = 1e-5
MAX_STOP_STRINGS = 64  # per request (OpenAI allows 4; vLLM has no bound)
MAX_STOP_STRING_CHARS = 1024
# Token constraints. logit_bias: OpenAI's range; 1,024 biased tokens a request (each is an
# entry of the step's scatter). allowed_token_ids: no more ids than the model's vocabulary
# (checked by the engine, which knows it); MAX_ALLOWED_TOKEN_IDS only refuses absurd lists
# before that. bad_words: tokenized once per request and matched against the request's last
# output tokens at every step, so their number and length are bounded like stop strings.
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # above every vocabulary we know (Gemma 3: 262,144)
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 1024


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
    # Token constraints (vLLM's): logit_bias adds its value (in [-100, 100]) to a token's logit
    # (keys may be strings of integers, as OpenAI's JSON sends them: they become ints);
    # allowed_token_ids: only these may be sampled; bad_words: never generated (see
    # ``update_from_tokenizer`` for how a word becomes token sequences).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # KV-Compress (an engine started with enable_kvc): this request's KV budget, as tokens per
    # layer and KV head or as a rate (8 = keep an eighth); the last protected_window_size
    # tokens are never evicted; compress_once: only after the prompt. None: the engine default.
    max_cache_tokens: int | None = None
    compression_rate: float | None = None
    protected_window_size: int | None = None
    compress_once: bool | None = None
    # Free-form arguments for plugins (vLLM's ``extra_args``): the engine never reads them; a
    # KV connector's scheduler role may (e.g. a benchmark's probe).
    extra_args: dict[str, Any] | None = None
    # Set by the engine, never by users: beam-search requests take their tokens from the
    # scheduler (the runner must not append its own), and best_of > n computes logprobs only
    # to rank sequences (they are not returned).
    external_tokens: bool = field(default=False, repr=False)
    hide_logprobs: bool = field(default=False, repr=False)
    # Filled by the engine: the model's EOS ids, beyond which stop_token_ids also stop.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the engine (``update_from_tokenizer``): the token sequences of bad_words.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

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

    def _error(self, name: str, why: str) -> ValueError:
        """The ValueError for field ``name``: its name, why, and (at most 200 characters of)
        its value."""
        got = repr(getattr(self, name))
        got = got if len(got) <= 200 else got[:200] + "..."  # a 100,000-string stop list
        return ValueError(f"{name} {why}, got {got}.")

    def _verify(self) -> None:
        bad = self._error

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
        # bounds: every stop string is searched for in every new piece of text of the request,
        # so an unbounded list would slow the whole engine
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"must hold at most {MAX_STOP_STRINGS} strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise bad("stop", f"strings must be at most {MAX_STOP_STRING_CHARS} characters long")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            raise bad("stop_token_ids", f"must hold at most {MAX_STOP_STRINGS} ids")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must contain only non-negative integers")
        self.verify_token_constraints()
        self._verify_kvc(bad)

    def verify_token_constraints(self) -> None:
        """Check logit_bias, allowed_token_ids, bad_words (ValueError naming the field);
        logit_bias keys become ints and values floats. Part of ``__post_init__``; the engine
        calls it again on its copy (they may have been set since), then checks the ids
        against the model's vocabulary (InputProcessor)."""
        bad = self._error
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a mapping of token ids to biases")
            if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
                raise bad("logit_bias", f"must hold at most {MAX_LOGIT_BIAS_TOKENS} tokens")
            biases: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                tid = _token_id(key)
                if tid is None:
                    raise bad("logit_bias", f"keys must be integer token ids >= 0 ({key!r})")
                if tid in biases:
                    raise bad("logit_bias", f"names token id {tid} twice")
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                    or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS
                ):
                    raise bad("logit_bias", f"values must be numbers in [-100, 100] ({value!r})")
                biases[tid] = float(value)
            self.logit_bias = biases
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)):
                raise bad("allowed_token_ids", "must be a list of token ids")
            if len(ids) == 0:
                raise bad("allowed_token_ids", "must not be empty when given")
            if len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise bad("allowed_token_ids", f"must hold at most {MAX_ALLOWED_TOKEN_IDS} ids")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise bad("allowed_token_ids", "must contain only non-negative integers")
            self.allowed_token_ids = list(ids)
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)):
                raise bad("bad_words", "must be a list of strings")
            if len(words) > MAX_BAD_WORDS:
                raise bad("bad_words", f"must hold at most {MAX_BAD_WORDS} words")
            if any(not isinstance(w, str) or not w.strip() for w in words):
                raise bad("bad_words", "must contain only strings with a non-space character")
            if any(len(w) > MAX_BAD_WORD_CHARS for w in words):
                raise bad("bad_words", f"words must be at most {MAX_BAD_WORD_CHARS} characters")
            self.bad_words = list(words)

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize ``bad_words`` into ``bad_words_token_ids`` (the engine does it once per
        request). As vLLM: each word, leading spaces stripped, is encoded as it is (the word at
        the start of a text) and with one leading space (inside a text, where tokenizers fold
        the space into the first token); the spaced form is kept when it starts with another
        token and has as many tokens (else the space is a token of its own and the plain form
        covers the word). A sequence [t1..tk] bans tk right after the output tokens t1..tk-1
        (k = 1: always)."""
        if not self.bad_words:
            self.bad_words_token_ids = None
            return
        seqs: list[list[int]] = []
        for word in self.bad_words:
            word = word.lstrip()
            plain = list(tokenizer.encode(word, add_special_tokens=False))
            if not plain:
                raise ValueError(f"bad_words word {word[:200]!r} has no tokens.")
            spaced = list(tokenizer.encode(" " + word, add_special_tokens=False))
            forms = [plain]
            if len(spaced) == len(plain) and spaced[0] != plain[0]:
                forms.append(spaced)
            seqs += [f for f in forms if f not in seqs]
        self.bad_words_token_ids = seqs

    def _verify_kvc(self, bad) -> None:  # noqa: ANN001
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
    def bad_words_need_history(self) -> bool:
        """Whether a bad word is several tokens long: its last token is banned only after the
        others, so each step looks at the request's last output tokens on the host."""
        return any(len(seq) > 1 for seq in self.bad_words_token_ids or ())

    @property
    def uses_token_constraints(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words change this request's logits."""
        return (
            bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
        )

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def beam_sampling_params(params: BeamSearchParams) -> SamplingParams:
    """The SamplingParams of a beam search's requests: greedy logits with enough top
    logprobs for the search to pick ``max(2, 1 + num_eos) x beam_width`` continuations; the
    tokens come from the search (``external_tokens``), which ends its hypotheses itself (the
    engine's own cap stays one token past ``max_tokens``)."""
    keep = max(2, 1 + (0 if params.ignore_eos else 1)) * params.beam_width
    sp = SamplingParams(
        temperature=0.0, max_tokens=params.max_tokens + 1, ignore_eos=True, logprobs=keep
    )
    sp.external_tokens = True
    return sp


def check_compression_rate(value: Any, name: str = "compression_rate") -> None:
    """A compression rate is a finite number >= 1 (8 = keep an eighth of the KVs), or None
    (``SamplingParams.compression_rate``, and ``KVCompressConfig``'s engine-wide default)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number >= 1, got {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be a finite number >= 1, got {value!r}.")


def _token_id(key: object) -> int | None:
    """A logit_bias key as a token id: a non-negative int, or a string of one (OpenAI's JSON
    keys are strings); None if it is neither."""
    if isinstance(key, bool):
        return None
    if isinstance(key, str):
        key = key.strip()
        if not key.isascii() or not key.isdigit() or len(key) > 18:  # no 5,000-digit int()
            return None
        key = int(key)
    return key if isinstance(key, int) and key >= 0 else None
