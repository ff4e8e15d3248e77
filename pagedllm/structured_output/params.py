"""What a request asks its output to match."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# JSON outputs of structured outputs: most whitespace characters in a row, by default (the
# engine's ``--structured-outputs-max-whitespace`` sets its own, 0: compact JSON). A bound keeps
# a weak model from wandering in tabs and newlines for ever; larger bounds make larger grammars
# (xgrammar unrolls the runs: ~0.5 MB serialized at 64), so the engine's setting is capped.
MAX_JSON_WHITESPACE = 8
MAX_JSON_WHITESPACE_SETTING = 64


@dataclass
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, dict or string), ``json_object`` (any JSON
    object), ``regex``, ``grammar`` (EBNF, xgrammar's dialect of GBNF), ``choice`` (one of the
    given strings)."""

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    # JSON's whitespace (vLLM's name): True none at all (compact JSON); False runs of at most
    # the engine's max_whitespace characters between tokens of the JSON (MAX_JSON_WHITESPACE
    # where the engine's is 0), so a weak model cannot wander in tabs and newlines for ever;
    # None (not set) the engine's setting (``--structured-outputs-max-whitespace``)
    disable_any_whitespace: bool | None = None
    # Reasoning models (a server's ``--reasoning-parser``): the constraint starts after this
    # token (``</think>``); the tokens before it, and it, are sampled freely. None: from the
    # first token. Not part of the compile key: the grammar is the same.
    reasoning_end_token_id: int | None = None
    # With it: the token that opens the thinking (``<think>``) when the output may or may not
    # think (Qwen3): if the first token is another, there is no thinking and the grammar starts
    # with that token (judged by the matcher after the fact). None: the output starts inside
    # the thinking.
    reasoning_start_token_id: int | None = None

    def __post_init__(self) -> None:
        given = [
            k
            for k in ("json", "json_object", "regex", "grammar", "choice")
            if getattr(self, k) not in (None, False)
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, grammar, "
                f"choice; got {given or 'none'}."
            )
        if self.disable_any_whitespace is not None and not isinstance(
            self.disable_any_whitespace, bool
        ):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean.")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must contain non-empty strings.")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (object or string).")
        for name in ("reasoning_end_token_id", "reasoning_start_token_id"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"structured_outputs.{name} must be a token id.")
        if self.reasoning_start_token_id is not None and self.reasoning_end_token_id is None:
            raise ValueError(
                "structured_outputs.reasoning_start_token_id needs reasoning_end_token_id."
            )
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")

    def key(self, max_whitespace: int = MAX_JSON_WHITESPACE) -> tuple[str, str]:
        """(kind, canonical spec): the compile cache key. A JSON kind carries its whitespace
        bound (``json:ws8``; ``json:ws0`` is compact), resolved against ``max_whitespace``,
        the engine's default for requests that do not set ``disable_any_whitespace``."""
        if self.json is not None:
            schema = (
                self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            )
            return f"json:ws{self.json_whitespace(max_whitespace)}", schema
        if self.json_object:
            return f"json_object:ws{self.json_whitespace(max_whitespace)}", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "grammar", self.grammar
        return "choice", json.dumps(self.choice)

    def json_whitespace(self, max_whitespace: int = MAX_JSON_WHITESPACE) -> int:
        """The longest whitespace run this request's JSON may hold (0: compact JSON): its own
        ``disable_any_whitespace`` when set, else the engine's ``max_whitespace``."""
        if self.disable_any_whitespace is None:
            return max_whitespace
        if self.disable_any_whitespace:
            return 0
        return max_whitespace or MAX_JSON_WHITESPACE  # whitespace asked for: bounded, not none

    @classmethod
    def from_any(cls, value: Any) -> StructuredOutputsParams:
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {"json", "json_object", "regex", "grammar", "choice", "disable_any_whitespace",
                     "reasoning_end_token_id", "reasoning_start_token_id"}  # fmt: skip
            unknown = set(value) - known
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {sorted(unknown)}.")
            return cls(**value)
        raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict.")
