"""``SpeculativeConfig``: vLLM's ``speculative_config`` for the methods this engine has.

Built from the dict a user passes (offline ``speculative_config={...}``, or the JSON of
``--speculative-config '{...}'``) by :meth:`SpeculativeConfig.from_dict`, which fills vLLM's
defaults and raises ``ValueError`` naming the field for anything wrong. The field names and the
defaults are vLLM's (``vllm/config/speculative.py``); only the three methods below exist here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "ngram_gpu", "suffix", "draft_model")
# the methods that look up n-grams (prompt_lookup_min / _max): on the host, or on the device
NGRAM_METHODS = ("ngram", "ngram_gpu")
# the most draft tokens one step verifies (the engine sizes its lookahead slots and its CUDA
# graphs of multi-token rows by it)
MAX_NUM_SPECULATIVE_TOKENS = 16
# vLLM's value for prompt_lookup_min and prompt_lookup_max when neither is given
DEFAULT_PROMPT_LOOKUP = 5

_NGRAM_FIELDS = ("prompt_lookup_min", "prompt_lookup_max")
_SUFFIX_FIELDS = (
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
)
_FIELDS = (
    "method",
    "num_speculative_tokens",
    "model",
    "disable_by_batch_size",
    "disable_when_slower",
    *_NGRAM_FIELDS,
    *_SUFFIX_FIELDS,
)


def _error(name: str, why: str, value: Any) -> ValueError:
    return ValueError(f"speculative_config.{name} {why}, got {value!r}.")


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(name, "must be an integer", value)
    if value < lo or (hi is not None and value > hi):
        where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _error(name, f"must be {where}", value)
    return value


def _check_float(name: str, value: Any, lo: float, hi: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _error(name, "must be a number", value)
    if not math.isfinite(value) or value < lo or (hi is not None and value > hi):
        where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _error(name, f"must be a finite number {where}", value)
    return float(value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: which proposer, how many draft tokens per step, its knobs.

    Build it with :meth:`from_dict`; ``__post_init__`` checks a config built directly but fills
    nothing in.

    - ``method``: ``"ngram"`` (prompt lookup), ``"ngram_gpu"`` (the same lookup on the device,
      as vLLM's: drafts never go through the host, so the engine keeps asynchronous steps
      while speculating; see ``pagedllm/spec_decode/ngram_gpu.py``), ``"suffix"`` (suffix
      decoding, as Arctic Inference and vLLM), or ``"draft_model"`` (a smaller model with the
      same tokenizer). As in vLLM, a dict with a ``model`` and no ``method`` means
      ``"draft_model"``.
    - ``num_speculative_tokens`` (k): the most draft tokens per request per step, 1 to
      ``MAX_NUM_SPECULATIVE_TOKENS``. Required for ngram, ngram_gpu and draft_model. For suffix
      it is only a cap (the proposer picks each draft's length) and defaults, as in vLLM, to
      ``suffix_decoding_max_tree_depth`` -- clipped to ``MAX_NUM_SPECULATIVE_TOKENS`` here, since
      vLLM's default depth (24) is above the engine's limit.
    - ``prompt_lookup_min`` / ``prompt_lookup_max`` (ngram and ngram_gpu): the n-gram sizes
      tried, largest first. vLLM's defaults: both 5 when neither is given; when only one is
      given the other takes its value.
    - ``model`` (draft_model only, required): the draft model's path or name.
    - ``disable_by_batch_size`` (None: never): while at least this many requests run, steps
      propose no drafts (under load a step is no longer bound by reading the weights, and
      verifying drafts that get rejected only costs compute); the engine then runs
      asynchronous steps if it may. At least 2, as in vLLM.
    - ``disable_when_slower`` (False; not in vLLM): time steps with and without drafts at
      each load level (running requests, by powers of two), measure the acceptance all along
      (shadow drafts while paused) and speculate only where that makes it faster
      (``pagedllm.core.sched.spec.SpecPacer``). The tokens are the same either way.
    - ``suffix_decoding_max_tree_depth`` (24): depth of the suffix trees; bounds the matched
      suffix plus the draft.
    - ``suffix_decoding_max_cached_requests`` (10000): how many finished requests' outputs the
      global tree keeps (the oldest leaves first); 0 turns the global tree off.
    - ``suffix_decoding_max_spec_factor`` (1.0): a draft after a match of m tokens has at most
      ``floor(factor * m)`` tokens.
    - ``suffix_decoding_min_token_prob`` (0.1): a draft stops where the product of its tokens'
      estimated probabilities (child count / parent count) would fall below this.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    disable_by_batch_size: int | None = None
    disable_when_slower: bool = False
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise _error("method", f"must be one of {list(METHODS)}", self.method)
        _check_int(
            "num_speculative_tokens", self.num_speculative_tokens, 1, MAX_NUM_SPECULATIVE_TOKENS
        )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model.strip():
                raise _error(
                    "model", "must name the draft model for method 'draft_model'", self.model
                )
        elif self.model is not None:
            raise _error(
                "model",
                f"only applies to method 'draft_model' (method is {self.method!r})",
                self.model,
            )
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 2)
        if not isinstance(self.disable_when_slower, bool):
            raise _error("disable_when_slower", "must be true or false", self.disable_when_slower)
        if self.method in NGRAM_METHODS:
            lo = _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
            hi = _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
            if lo > hi:
                raise _error("prompt_lookup_min", f"must be <= prompt_lookup_max ({hi})", lo)
        else:
            for name in _NGRAM_FIELDS:
                if getattr(self, name) is not None:
                    raise _error(
                        name,
                        f"only applies to methods 'ngram' and 'ngram_gpu' (method is "
                        f"{self.method!r})",
                        getattr(self, name),
                    )
        _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1)
        _check_int(
            "suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0
        )
        _check_float("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, 0.0)
        _check_float(
            "suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, 0.0, 1.0
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        """The config for ``d`` (vLLM's keys), with vLLM's defaults filled in.

        Raises ``ValueError`` naming the field for an unknown key, a value of the wrong type or
        out of range, a method other than ngram/ngram_gpu/suffix/draft_model, a missing
        ``num_speculative_tokens`` (ngram, ngram_gpu, draft_model) or ``model`` (draft_model), a
        key that belongs to another method, or ``prompt_lookup_min > prompt_lookup_max``.
        """
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a JSON object (dict), got {d!r}.")
        unknown = sorted(str(key) for key in d if key not in _FIELDS)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {unknown}; the known keys are "
                f"{list(_FIELDS)}."
            )
        kw = dict(d)
        method = kw.get("method")
        if method is None:
            if kw.get("model") is None:
                raise _error("method", f"is required (one of {list(METHODS)})", None)
            method = kw["method"] = "draft_model"  # vLLM: a model and no method is a draft
        if method not in METHODS:
            raise _error("method", f"must be one of {list(METHODS)}", method)
        if method != "suffix":
            for name in _SUFFIX_FIELDS:
                if name in kw:
                    raise _error(
                        name, f"only applies to method 'suffix' (method is {method!r})", kw[name]
                    )
        if method in NGRAM_METHODS:
            lo, hi = kw.get("prompt_lookup_min"), kw.get("prompt_lookup_max")
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if value is not None:  # checked before one fills the other
                    _check_int(name, value, 1)
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            kw["prompt_lookup_min"], kw["prompt_lookup_max"] = lo, hi
        for name in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            value = kw.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                kw[name] = float(value)
        if kw.get("num_speculative_tokens") is None:
            if method != "suffix":
                raise _error("num_speculative_tokens", f"is required for method {method!r}", None)
            depth = _check_int(
                "suffix_decoding_max_tree_depth", kw.get("suffix_decoding_max_tree_depth", 24), 1
            )
            kw["num_speculative_tokens"] = min(depth, MAX_NUM_SPECULATIVE_TOKENS)
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The config for the JSON text of ``--speculative-config`` (``ValueError`` if bad)."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}.") from None
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """The keys that matter for this method, as ``from_dict`` takes them back (a JSON round
        trip gives an equal config)."""
        out: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if self.disable_by_batch_size is not None:
            out["disable_by_batch_size"] = self.disable_by_batch_size
        if self.disable_when_slower:
            out["disable_when_slower"] = True
        if self.method == "draft_model":
            out["model"] = self.model
        elif self.method in NGRAM_METHODS:
            out["prompt_lookup_min"] = self.prompt_lookup_min
            out["prompt_lookup_max"] = self.prompt_lookup_max
        else:
            for name in _SUFFIX_FIELDS:
                out[name] = getattr(self, name)
        return out
