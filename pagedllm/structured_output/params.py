"""What a request asks its output to match."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_JSON_WHITESPACE = 8  # characters of whitespace in a row in JSON outputs, by default


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
    # JSON's whitespace (vLLM's name): False allows runs of at most MAX_JSON_WHITESPACE
    # characters between tokens of the JSON (a weak model cannot wander in tabs and newlines
    # for ever), True none at all (compact JSON)
    disable_any_whitespace: bool = False

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
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a boolean.")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must contain non-empty strings.")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (object or string).")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")

    def key(self) -> tuple[str, str]:
        """(kind, canonical spec): the compile cache key."""
        if self.json is not None:
            schema = (
                self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
            )
            return "json" + self._ws(), schema
        if self.json_object:
            return "json_object" + self._ws(), ""
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "grammar", self.grammar
        return "choice", json.dumps(self.choice)

    def _ws(self) -> str:
        return ":compact" if self.disable_any_whitespace else ""

    @classmethod
    def from_any(cls, value: Any) -> StructuredOutputsParams:
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {"json", "json_object", "regex", "grammar", "choice", "disable_any_whitespace"}
            unknown = set(value) - known
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {sorted(unknown)}.")
            return cls(**value)
        raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict.")
